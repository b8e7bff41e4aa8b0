"""What the tier may ask of vLLM's CPU build on this machine's CPU.

vLLM's CPU attention (vllm/v1/attention/backends/cpu_attn.py, `_get_attn_isa`)
refuses a quantized KV cache (`--kv-cache-dtype fp8`, or any fp8_* / int4 /
nvfp4 name) unless torch reports AMX tiles (`torch.cpu._is_amx_tile_supported`:
the `amx_tile` flag) or AVX-512 (`torch.cpu._is_avx512_supported`: avx512f,
avx512vl, avx512bw and avx512dq together): "FP8 KV cache on CPU requires x86
with AVX-512 or AMX", and `vllm serve` exits. Its other KV dtypes (bfloat16,
float16) are not the tier's float32 model dtype, which the CPU kernels need the
cache to share, so an AVX2-only CPU (an AMD EPYC before Zen 4) has no KV-cache
dtype change to offer: the tests leave that part out and say why.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

AVX512_FLAGS = frozenset({"avx512f", "avx512vl", "avx512bw", "avx512dq"})
AMX_FLAG = "amx_tile"
FP8_KV = "fp8"


@dataclass(frozen=True)
class DtypeChange:
    """The `--kv-cache-dtype` a restart may switch to here (None: none), and why."""
    dtype: str | None
    reason: str

    @property
    def flags(self) -> tuple[str, ...]:
        return ("--kv-cache-dtype", self.dtype) if self.dtype else ()


def cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The first processor's `flags` of /proc/cpuinfo's text (x86 only: empty elsewhere)."""
    for line in cpuinfo.splitlines():
        name, sep, value = line.partition(":")
        if sep and name.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def kv_cache_dtype_change(flags: frozenset[str]) -> DtypeChange:
    """fp8 where vLLM's CPU attention takes it (AMX, or all four AVX-512 flags), else none."""
    if AMX_FLAG in flags:
        return DtypeChange(FP8_KV, "the CPU has AMX tiles (amx_tile): vLLM's CPU attention takes an fp8 KV cache")
    if AVX512_FLAGS <= flags:
        return DtypeChange(FP8_KV, "the CPU has AVX-512 (avx512f/vl/bw/dq): vLLM's CPU attention takes an fp8 "
                                   "KV cache")
    missing = ", ".join(sorted(AVX512_FLAGS - flags))
    return DtypeChange(None, f"the KV-cache dtype change is left out: vLLM's CPU attention takes an fp8 KV cache "
                             f"only with AVX-512 or AMX, this CPU lacks {missing} and amx_tile, and its other "
                             f"KV dtypes (bfloat16, float16) differ from the tier's float32 model")


def this_cpu_kv_cache_dtype_change(cpuinfo: Path = Path("/proc/cpuinfo")) -> DtypeChange:
    try:
        text = cpuinfo.read_text(encoding="utf-8", errors="replace")
    except OSError:
        text = ""
    return kv_cache_dtype_change(cpu_flags(text))
