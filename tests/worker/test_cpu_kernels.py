"""The native kernel's build cache is keyed by the CPU it was built for (-march=native)."""

from __future__ import annotations

from zeroserve.worker.cpu_kernels import cpu_tag

EPYC = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 1
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse2 avx avx2 fma
bogomips\t: 4899.99

processor\t: 1
vendor_id\t: AuthenticAMD
flags\t\t: fpu sse2 avx avx2 fma avx512f
"""


def test_the_tag_changes_with_the_cpu_features_only():
    tag = cpu_tag(EPYC)
    assert tag == cpu_tag(EPYC.replace("4899.99", "4901.00"))  # clock noise: same CPU
    assert tag == cpu_tag(EPYC.replace("avx avx2", "avx2 avx"))  # flag order
    assert tag != cpu_tag(EPYC.replace("avx2 fma\n", "avx2 fma avx512f avx512_bf16\n", 1))
    assert tag != cpu_tag(EPYC.replace("EPYC 7B13", "EPYC 9B14"))
    assert len(tag) == 12 and tag.isalnum()
    assert cpu_tag() == cpu_tag()  # this machine's
