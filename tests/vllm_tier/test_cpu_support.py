"""The KV-cache dtype change the tier asks of vLLM, chosen from the CPU's flags.

These run in the default tier (no vLLM needed), over /proc/cpuinfo texts of the
kinds of machine CI lands on.
"""

import pytest

from .cpu_support import cpu_flags, kv_cache_dtype_change, this_cpu_kv_cache_dtype_change

BASE = ("fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse sse2 ht "
        "syscall nx mmxext fxsr_opt pdpe1gb rdtscp lm constant_tsc rep_good nopl cpuid pni pclmulqdq ssse3 fma "
        "cx16 sse4_1 sse4_2 x2apic movbe popcnt aes xsave avx f16c rdrand hypervisor lahf_lm abm sse4a "
        "bmi1 avx2 smep bmi2 erms")
# An AMD EPYC 7763 (Zen 3): AVX2, no AVX-512, no AMX.
EPYC_ZEN3 = BASE + " invpcid rdseed adx smap clflushopt clwb sha_ni xsaveopt xsavec xgetbv1 clzero xsaveerptr vaes"
# An Intel Xeon (Skylake-SP): AVX-512 F/CD/BW/DQ/VL, no AMX.
XEON_SKYLAKE = BASE + " avx512f avx512dq rdseed adx smap clflushopt clwb avx512cd avx512bw avx512vl xsaveopt"
# An Intel Xeon (Sapphire Rapids): AVX-512 and AMX.
XEON_SAPPHIRE = XEON_SKYLAKE + " avx512_bf16 amx_bf16 avx512_fp16 amx_tile amx_int8"


def cpuinfo(flags: str, processors: int = 2) -> str:
    block = "processor\t: {n}\nvendor_id\t: x\nmodel name\t: some cpu\nflags\t\t: {flags}\nbogomips\t: 4890.85\n"
    return "\n".join(block.format(n=n, flags=flags) for n in range(processors))


@pytest.mark.parametrize("flags, dtype, said", [
    (XEON_SKYLAKE, "fp8", "AVX-512"),
    (XEON_SAPPHIRE, "fp8", "AMX"),
    (EPYC_ZEN3, None, "lacks avx512bw, avx512dq, avx512f, avx512vl and amx_tile"),
    # avx512f alone is not torch's AVX-512: it wants BW, DQ and VL as well.
    (BASE + " avx512f avx512cd", None, "lacks avx512bw, avx512dq, avx512vl and amx_tile"),
])
def test_the_dtype_change_follows_the_cpu_flags(flags, dtype, said):
    change = kv_cache_dtype_change(cpu_flags(cpuinfo(flags)))
    assert change.dtype == dtype
    assert said in change.reason
    assert change.flags == (("--kv-cache-dtype", dtype) if dtype else ())


def test_a_cpuinfo_without_x86_flags_offers_no_change():
    arm = "processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics\n"
    assert cpu_flags(arm) == frozenset()
    assert kv_cache_dtype_change(cpu_flags(arm)).dtype is None
    assert cpu_flags("") == frozenset()


def test_an_unreadable_cpuinfo_offers_no_change(tmp_path):
    assert this_cpu_kv_cache_dtype_change(tmp_path / "absent").dtype is None


def test_the_file_is_read_as_proc_cpuinfo(tmp_path):
    (tmp_path / "cpuinfo").write_text(cpuinfo(XEON_SAPPHIRE, processors=4))
    assert this_cpu_kv_cache_dtype_change(tmp_path / "cpuinfo").dtype == "fp8"
    (tmp_path / "cpuinfo").write_text(cpuinfo(EPYC_ZEN3))
    assert this_cpu_kv_cache_dtype_change(tmp_path / "cpuinfo").dtype is None
