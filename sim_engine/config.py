"""Engine configuration: every constant of the simulated engine is a command-line flag.

The defaults model **Llama-3.1-8B-Instruct in bf16 served by vLLM on one 80 GB H100 SXM**. Each flag's
help text gives its derivation and source; the numbers used throughout:

* Llama-3.1-8B (``config.json`` on the model card): 8.03e9 parameters, 32 layers, hidden 4096,
  32 attention heads, 8 KV heads (GQA), head_dim 128, vocabulary 128,256, context 131,072.
* H100 SXM 80 GB (NVIDIA datasheet): 3.35 TB/s HBM3, 989 TFLOP/s dense bf16.
* KV bytes per token = 2 (K and V) x 32 layers x 8 KV heads x 128 head_dim x 2 bytes = 131,072 B.
* Weights = 8.03e9 x 2 B = 16.06 GB, read once per forward pass.

Tokens are whitespace-separated words (see :mod:`sim_engine.tokenizer`).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

DEFAULT_MODEL = "sim-llama-3.1-8b"


@dataclass
class EngineConfig:
    """All knobs of :class:`sim_engine.engine.EngineCore` and the server (see the flags' help)."""

    model: str = DEFAULT_MODEL
    block_size: int = 16
    num_gpu_blocks: int = 27_000
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 131_072
    default_max_tokens: int = 256
    enable_prefix_caching: bool = True
    reserve_full_prompt: bool = True
    base_step_ms: float = 5.0
    per_seq_ms: float = 0.05
    per_context_token_ns: float = 39.0
    prefill_per_token_ms: float = 0.0325
    prefill_attention_ns_per_pair: float = 1.06
    slowdown: float = 1.0
    time_scale: float = 1.0
    seed: int = 0
    vocab_size: int = 128_256

    def validate(self) -> EngineConfig:
        """Check ranges; raises ``ValueError`` naming the field, the value and the reason."""
        positive_int = (
            "block_size",
            "num_gpu_blocks",
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_model_len",
            "default_max_tokens",
            "vocab_size",
        )
        for name in positive_int:
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r}: must be an integer >= 1")
        for name in (
            "base_step_ms",
            "per_seq_ms",
            "per_context_token_ns",
            "prefill_per_token_ms",
            "prefill_attention_ns_per_pair",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)!r}: must be >= 0")
        for name in ("slowdown", "time_scale"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)!r}: must be > 0")
        return self


def add_engine_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add every :class:`EngineConfig` flag, with derivation and source in its help text."""
    d = EngineConfig()
    g = p.add_argument_group("model and cache")
    g.add_argument(
        "--model",
        "--served-model-name",
        dest="model",
        default=d.model,
        help="Model name served in /v1/models and accepted in the 'model' field.",
    )
    g.add_argument(
        "--block-size",
        type=int,
        default=d.block_size,
        help="Tokens per KV-cache block (vLLM's default --block-size on CUDA is 16).",
    )
    g.add_argument(
        "--num-gpu-blocks",
        type=int,
        default=d.num_gpu_blocks,
        help="KV-cache budget in blocks. Derivation: 80 GiB x 0.9 (vLLM --gpu-memory-utilization) "
        "= 77.3 GB, minus 16.06 GB of bf16 weights (8.03e9 params x 2 B), minus ~4 GB for "
        "activations and CUDA graphs (vLLM's profiling run) = ~57 GB; / 131,072 B per token "
        "(2 x 32 layers x 8 KV heads x 128 head_dim x 2 B, Llama-3.1-8B config.json) = ~436k "
        "tokens = ~27,000 blocks of 16.",
    )
    g.add_argument(
        "--max-num-seqs",
        type=int,
        default=d.max_num_seqs,
        help="Most sequences in one batch (vLLM's --max-num-seqs, 256 in its engine args).",
    )
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=d.max_num_batched_tokens,
        help="Token budget of one step; longer prefills are chunked (vLLM V1's default for online "
        "serving on large GPUs is 8192).",
    )
    g.add_argument(
        "--max-model-len",
        type=int,
        default=d.max_model_len,
        help="Context window, prompt + output tokens (Llama-3.1's max_position_embeddings, 131072).",
    )
    g.add_argument(
        "--default-max-tokens",
        type=int,
        default=d.default_max_tokens,
        help="Output length when a request gives no max_tokens. vLLM uses the rest of the context; "
        "a simulated engine never samples EOS, so it caps unbounded requests here.",
    )
    g.add_argument(
        "--no-prefix-caching",
        dest="enable_prefix_caching",
        action="store_false",
        help="Disable automatic prefix caching (vLLM's --no-enable-prefix-caching).",
    )
    g.add_argument(
        "--no-reserve-full-prompt",
        dest="reserve_full_prompt",
        action="store_false",
        help="Admit a waiting request when its first prefill chunk fits, not its whole prompt "
        "(vLLM before scheduler_reserve_full_isl; with it, the default of vLLM 0.32, the whole "
        "prompt's blocks must be free at admission).",
    )
    g.add_argument(
        "--vocab-size",
        type=int,
        default=d.vocab_size,
        help="Token ids reported by /tokenize and the render endpoints are crc32(word) mod this "
        "(Llama-3 vocabulary: 128,256).",
    )
    t = p.add_argument_group("step-time model: step = base + sum(per-seq + context terms) + prefill cost")
    t.add_argument(
        "--base-step-ms",
        type=float,
        default=d.base_step_ms,
        help="Fixed cost of one forward pass: the 16.06 GB of weights read once from HBM at "
        "3.35 TB/s (H100 SXM datasheet) = 4.8 ms, plus launch overhead; vLLM's measured "
        "inter-token latency for 8B models on one H100 at batch 1 is about 6 ms.",
    )
    t.add_argument(
        "--per-seq-ms",
        type=float,
        default=d.per_seq_ms,
        help="Cost per sequence in the batch: one token through 8.03e9 params = 16.06 GFLOP at "
        "~50%% of 989 TFLOP/s = 0.032 ms, plus ~0.02 ms sampling and scheduling. With the "
        "context term a decode step at batch 256 with 1k-token contexts takes 5 + 12.8 + "
        "10 = ~28 ms (~9k tokens/s).",
    )
    t.add_argument(
        "--per-context-token-ns",
        type=float,
        default=d.per_context_token_ns,
        help="Decode attention reads each context token's KV once per step: 131,072 B / 3.35 TB/s "
        "= 39 ns per context token.",
    )
    t.add_argument(
        "--prefill-per-token-ms",
        type=float,
        default=d.prefill_per_token_ms,
        help="Prefill cost per uncached prompt token: 2 x 8.03e9 FLOP / (989 TFLOP/s x 0.5 MFU) = "
        "0.0325 ms, i.e. ~31k prefill tokens/s, in line with published vLLM H100 prefill "
        "throughput for 8B models.",
    )
    t.add_argument(
        "--prefill-attention-ns-per-pair",
        type=float,
        default=d.prefill_attention_ns_per_pair,
        help="Prefill attention per (new token, context token) pair: 4 x 32 layers x 4096 hidden = "
        "524,288 FLOP at 494 TFLOP/s = 1.06 ns; makes long prompts "
        "super-linear as in FlashAttention.",
    )
    t.add_argument(
        "--slowdown",
        type=float,
        default=d.slowdown,
        help="Multiply every step time by this factor (3 = an engine three times slower, e.g. an older GPU).",
    )
    r = p.add_argument_group("simulation")
    r.add_argument(
        "--time-scale",
        type=float,
        default=d.time_scale,
        help="Run F times faster than real time: a step of T simulated seconds sleeps T/F wall "
        "seconds. Latencies in /metrics are wall-clock seconds (simulated / F), as a client measures them.",
    )
    r.add_argument(
        "--seed",
        type=int,
        default=d.seed,
        help="Seed of the generated words; the same seed and arrivals give the same outputs.",
    )
    return p


def config_from_args(ns: argparse.Namespace) -> EngineConfig:
    """Build a validated :class:`EngineConfig` from parsed flags (unknown attributes are ignored)."""
    names = {f.name for f in fields(EngineConfig)}
    return EngineConfig(**{k: v for k, v in vars(ns).items() if k in names}).validate()
