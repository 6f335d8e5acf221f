"""Every script in tools/ and examples/ still imports what it uses and answers ``--help``.

The benchmarks and examples run on demand, not in the suite (the README's example
and ``tools/bench.py --smoke`` have tests of their own); this keeps the rest from
rotting unnoticed, as ``tools/bench_spmd.py`` did when a name it imported went away.
All scripts run in one fresh process (torch is imported once), each as ``__main__``
with ``--help``.
"""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).parents[1]
SCRIPTS = sorted([*ROOT.glob("tools/*.py"), *ROOT.glob("examples/*.py")])

RUN_EACH_WITH_HELP = textwrap.dedent("""
    import contextlib, io, json, os, runpy, sys, traceback
    answers = {}
    for path in sys.argv[1:]:
        sys.argv = [path, "--help"]
        sys.path.insert(0, os.path.dirname(path))  # as `python PATH` does: the script's folder first
        printed = io.StringIO()
        try:
            with contextlib.redirect_stdout(printed):
                runpy.run_path(path, run_name="__main__")
            answers[path] = "ran without exiting: --help was not read"
        except SystemExit as done:
            answers[path] = printed.getvalue() if done.code in (0, None) else f"exit {done.code}"
        except BaseException:
            answers[path] = traceback.format_exc()
        sys.path.pop(0)
    print(json.dumps(answers))
""")


def test_every_tool_and_example_answers_help():
    result = subprocess.run([sys.executable, "-c", RUN_EACH_WITH_HELP, *map(str, SCRIPTS)], capture_output=True,
                            text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    answers = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(answers) == len(SCRIPTS) >= 15
    for path, answer in answers.items():
        assert answer.startswith("usage: "), f"{Path(path).relative_to(ROOT)} --help: {answer[-2000:]}"
