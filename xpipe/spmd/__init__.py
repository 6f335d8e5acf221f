"""The SPMD executor: a stacked, repeated body pipelined over a ("data", "stage", "fsdp") mesh."""
