"""Small Hugging Face models for the tests, built from the library's own classes and
configs with random weights (nothing is downloaded); and a stack of torch's own
``nn.TransformerEncoderLayer`` that trains as they do."""

from typing import NamedTuple

import torch
from transformers import (BertConfig, BertForMaskedLM, FalconConfig, FalconForCausalLM, Gemma2Config,
                          Gemma2ForCausalLM, GPT2Config, GPT2LMHeadModel, GPTNeoXConfig, GPTNeoXForCausalLM,
                          LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM, OPTConfig, OPTForCausalLM,
                          Phi3Config, Phi3ForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen2MoeConfig,
                          Qwen2MoeForCausalLM, T5Config, T5ForConditionalGeneration)


class Output(NamedTuple):
    loss: torch.Tensor


class EncoderStack(torch.nn.Module):
    """Four of torch's ``nn.TransformerEncoderLayer`` (4 heads, packed q/k/v), with a
    loss so that it trains as the Hugging Face models do: ``model(src).loss``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)

    def forward(self, src: torch.Tensor):
        return Output(self.encoder(src).square().mean())


def llama(layers: int = 4, heads: int = 4, kv_heads: int = 2, vocab: int = 128) -> LlamaForCausalLM:
    """Tied embeddings, grouped-query attention (4 heads, 2 key/value heads by default)."""
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, max_position_embeddings=64, tie_word_embeddings=True, use_cache=False))


def gpt2(layers: int = 4, dropout: float | None = None, vocab: int = 128) -> GPT2LMHeadModel:
    """GPT-2 as configured by default, or with every dropout probability set to ``dropout``."""
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=vocab, n_positions=32, n_embd=32, n_layer=layers, n_head=4, bos_token_id=0,
                        eos_token_id=0, use_cache=False)
    if dropout is not None:
        config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = dropout
    return GPT2LMHeadModel(config)


def mixtral(layers: int = 4) -> MixtralForCausalLM:
    """A mixture-of-experts decoder: 4 experts, 2 per token, routed by the data (its
    experts captured by xpipe in the dense form, :mod:`xpipe.capture.experts`)."""
    torch.manual_seed(0)
    return MixtralForCausalLM(MixtralConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, num_local_experts=4, num_experts_per_tok=2,
        use_cache=False))


def bert(layers: int = 4) -> BertForMaskedLM:
    """An encoder with its MLM head (tied to the word embeddings), dropout off."""
    torch.manual_seed(0)
    return BertForMaskedLM(BertConfig(
        vocab_size=128, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def t5(layers: int = 3) -> T5ForConditionalGeneration:
    """An encoder-decoder: the decoder's blocks read the encoder's output; dropout off."""
    torch.manual_seed(0)
    return T5ForConditionalGeneration(T5Config(
        vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=layers, num_heads=4, dropout_rate=0.0,
        decoder_start_token_id=0, pad_token_id=0, use_cache=False))


def falcon(layers: int = 4, multi_query: bool = True) -> FalconForCausalLM:
    """Falcon as configured by default (multi-query attention, rotary): torch.export
    lifts the index lists of its attention (``qkv[..., [-2]]``) as constants of every
    block. Without ``multi_query`` its ``query_key_value`` packs q, k and v head by head."""
    torch.manual_seed(0)
    return FalconForCausalLM(FalconConfig(vocab_size=128, hidden_size=32, num_hidden_layers=layers,
                                          num_attention_heads=4, multi_query=multi_query, use_cache=False))


def gemma2(layers: int = 4) -> Gemma2ForCausalLM:
    """Gemma 2 as configured by default but small: its layers alternate sliding-window
    and global attention, each reading its own mask (a window of 4 over 8 tokens, so
    the two masks differ)."""
    torch.manual_seed(0)
    return Gemma2ForCausalLM(Gemma2Config(vocab_size=128, hidden_size=32, intermediate_size=64,
                                          num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                          head_dim=8,
                                          max_position_embeddings=64, sliding_window=4, use_cache=False))


def opt(layers: int = 4) -> OPTForCausalLM:
    """OPT: separate q/k/v projections with biases, ``out_proj``, an MLP of ``fc1``/``fc2``; dropout off."""
    torch.manual_seed(0)
    return OPTForCausalLM(OPTConfig(vocab_size=128, hidden_size=32, ffn_dim=64, num_hidden_layers=layers,
                                    num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=32,
                                    dropout=0.0, attention_dropout=0.0, pad_token_id=1, bos_token_id=0,
                                    eos_token_id=0, use_cache=False))


def gpt_neox(layers: int = 4, vocab: int = 128) -> GPTNeoXForCausalLM:
    """GPT-NeoX: q, k and v packed per head in ``query_key_value``, parallel attention and MLP."""
    torch.manual_seed(0)
    return GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                                            num_hidden_layers=layers, num_attention_heads=4, max_position_embeddings=64,
                                            bos_token_id=0, eos_token_id=0, use_cache=False))


def phi3(layers: int = 4) -> Phi3ForCausalLM:
    """Phi-3: q, k and v packed one after the other in ``qkv_proj``, gate and up in ``gate_up_proj``."""
    torch.manual_seed(0)
    return Phi3ForCausalLM(Phi3Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      pad_token_id=0, bos_token_id=0, eos_token_id=0, use_cache=False))


def qwen2(layers: int = 4, vocab: int = 128) -> Qwen2ForCausalLM:
    """Qwen2: Llama's block with biases on q, k and v (grouped-query attention: 4 heads, 2 key/value heads)."""
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=64,
                                        tie_word_embeddings=True, use_cache=False))


def qwen2_moe(layers: int = 4) -> Qwen2MoeForCausalLM:
    """Qwen2-MoE: 4 routed experts (2 per token) beside a gated shared expert."""
    torch.manual_seed(0)
    return Qwen2MoeForCausalLM(Qwen2MoeConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
        shared_expert_intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        num_experts=4, num_experts_per_tok=2, max_position_embeddings=64, use_cache=False))


def tokens(rows: int = 2, seq: int = 8, vocab: int = 128) -> torch.Tensor:
    return torch.randint(0, vocab, (rows, seq), generator=torch.Generator().manual_seed(0))


def padding_mask(rows: int, seq: int = 8) -> torch.Tensor:
    """All ones but the first row, whose first three positions are padding."""
    mask = torch.ones(rows, seq, dtype=torch.long)
    mask[0, :3] = 0
    return mask


def assert_llama_step_matches(pipe, reference, ids: torch.Tensor, mask: torch.Tensor | None) -> None:
    """One backward of ``mean(logits**2)`` through ``pipe`` (a pipelined Llama) equals
    the same on ``reference`` (the model unpipelined, on the CPU): the logits and every
    gradient, rtol 1e-4 (``equivalence``). Without ``mask``, no ``attention_mask``."""
    import torch_xla
    from equivalence import ATOL, RTOL

    inputs = {"input_ids": ids} | ({} if mask is None else {"attention_mask": mask})
    output = pipe(**inputs)
    assert type(output).__name__ == "CausalLMOutputWithPast"
    output.logits.square().mean().backward()
    torch_xla.sync()
    expected = reference(**inputs).logits
    expected.square().mean().backward()
    torch.testing.assert_close(output.logits.cpu(), expected.detach(), rtol=RTOL, atol=ATOL)
    assert_gradients_match(pipe, reference)


def assert_loss_step_matches(pipe, reference, **inputs: torch.Tensor) -> None:
    """One backward of the model's own loss (``labels=`` among ``inputs``) through
    ``pipe`` equals the same on ``reference`` (unpipelined, on the CPU): the loss and
    every gradient, rtol 1e-4 (``equivalence``)."""
    import torch_xla
    from equivalence import ATOL, RTOL

    output = pipe(**inputs)
    output.loss.backward()
    torch_xla.sync()
    expected = reference(**inputs)
    expected.loss.backward()
    torch.testing.assert_close(output.loss.cpu(), expected.loss.detach(), rtol=RTOL, atol=ATOL)
    assert_gradients_match(pipe, reference)


def assert_gradients_match(pipe, reference) -> None:
    """Every parameter's gradient, under its name in the unpipelined ``reference``."""
    from equivalence import ATOL, RTOL, host_gradients

    gradients = host_gradients(pipe)
    for name, parameter in reference.named_parameters():
        assert name in gradients, f"{name} got no gradient"
        torch.testing.assert_close(gradients[name], parameter.grad, rtol=RTOL, atol=ATOL,
                                   msg=lambda m, name=name: f"gradient of {name}: {m}")

