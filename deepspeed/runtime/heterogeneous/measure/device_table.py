# SPDX-License-Identifier: Apache-2.0
"""The device kinds the fork knows, with the vendor document each number comes from.

Two users read it. A running job looks a device up by the name torch reports
(``devices.find_spec``, through each entry's ``aliases``) to give it a prior score before anything
is measured. ``deepspeed plan`` looks a kind up by its short key (``kind``: "A100-80GB",
"RTX-3090", ...) to predict a cluster that may not exist yet (docs/planning.md).

Every rate is a *dense* peak: vendors print tensor-core rates "with sparsity" (2:4 structured
sparsity) at twice the dense figure, and training does not run sparse, so the table holds the
halved figure where the datasheet prints only the sparse one. fp16/bf16 are tensor-core
(matrix-core) rates with fp32 accumulation, which is what training uses; GeForce cards run that at
half their fp16-accumulate rate. fp32 is the plain fp32 rate (TF32 off, PyTorch's matmul default);
AMD parts use their fp32 matrix rate, which rocBLAS uses for fp32 GEMM. MI250X figures are per GCD:
torch sees each of its two dies as one device, and ROCm reports MI250 and MI250X under the same
name. Pure data and lookups: no torch.
"""

from dataclasses import dataclass, field
from typing import Tuple


@dataclass(frozen=True)
class AcceleratorSpec:
    """Datasheet figures of one accelerator model: dense rates, no structured sparsity."""

    name: str
    aliases: Tuple[str, ...]
    """Model tokens as they appear in device names reported by torch (lower case)."""
    form_factor: str
    """'' for the reference part (SXM / OAM / the only variant), else 'pcie' or 'nvl'."""
    fp16_tflops: float
    bf16_tflops: float
    """0 where the hardware has no bf16 arithmetic."""
    fp32_tflops: float
    memory_gb: float
    bandwidth_gbps: float
    """Memory bandwidth in GB/s."""
    kind: str = ""
    """The short key a cluster description names the kind by (case-insensitive)."""
    source: str = field(default="", compare=False)
    """Key of ``DATASHEETS``: the vendor document the figures come from."""

    @property
    def supports_bf16(self):
        return self.bf16_tflops > 0


DATASHEETS = {
    "v100": ("NVIDIA V100 Tensor Core GPU datasheet",
             "https://images.nvidia.com/content/technologies/volta/pdf/volta-v100-datasheet-update-us-1165301-r5.pdf"),
    "t4": ("NVIDIA T4 Tensor Core GPU datasheet",
           "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/tesla-t4/"
           "t4-tensor-core-datasheet-951643.pdf"),
    "a10": ("NVIDIA A10 Tensor Core GPU datasheet",
            "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a10/pdf/A10-Product-Brief.pdf"),
    "l4": ("NVIDIA L4 Tensor Core GPU datasheet (FP16/BF16 printed with sparsity: 242)",
           "https://www.nvidia.com/en-us/data-center/l4/"),
    "l40s": ("NVIDIA L40S GPU datasheet (FP16/BF16 printed with sparsity: 733)",
             "https://www.nvidia.com/en-us/data-center/l40s/"),
    "a100": ("NVIDIA A100 Tensor Core GPU datasheet",
             "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
             "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"),
    "h100": ("NVIDIA H100 Tensor Core GPU datasheet (FP16/BF16 printed with sparsity: 1,979 SXM)",
             "https://www.nvidia.com/en-us/data-center/h100/"),
    "h200": ("NVIDIA H200 Tensor Core GPU datasheet (FP16/BF16 printed with sparsity)",
             "https://www.nvidia.com/en-us/data-center/h200/"),
    "ga102": ("NVIDIA Ampere GA102 GPU architecture whitepaper, appendix (GeForce RTX 3090)",
              "https://www.nvidia.com/content/PDF/nvidia-ampere-ga-102-gpu-architecture-whitepaper-v2.pdf"),
    "ada": ("NVIDIA Ada GPU architecture whitepaper, appendix (GeForce RTX 4090)",
            "https://images.nvidia.com/aem-dam/Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf"),
    "mi250x": ("AMD Instinct MI250X accelerator datasheet (per OAM: 383 FP16/BF16, 95.7 FP32 matrix, 128 GB, "
               "3.2 TB/s; halved per GCD)",
               "https://www.amd.com/en/products/accelerators/instinct/mi200/mi250x.html"),
    "mi300x": ("AMD Instinct MI300X accelerator datasheet",
               "https://www.amd.com/en/products/accelerators/instinct/mi300/mi300x.html"),
    "epyc7763": ("AMD EPYC 7763 product page (64 Zen 3 cores, 2.45 GHz base, 8 channels DDR4-3200); per core: "
                 "2 256-bit FMA pipes = 32 fp32 FLOP/cycle",
                 "https://www.amd.com/en/products/processors/server/epyc/7003-series/amd-epyc-7763.html"),
}
"""Source key -> (document name, URL)."""

_S = AcceleratorSpec
# name, aliases, form factor, fp16, bf16, fp32 (TFLOP/s), memory (GB), bandwidth (GB/s), kind, source.
ACCELERATOR_SPECS = (
    _S("V100 SXM2 16GB", ("v100", ), "", 125.0, 0.0, 15.7, 16, 900, "V100-16GB", "v100"),
    _S("V100 SXM2 32GB", ("v100", ), "", 125.0, 0.0, 15.7, 32, 900, "V100-32GB", "v100"),
    _S("V100 PCIe 16GB", ("v100", ), "pcie", 112.0, 0.0, 14.0, 16, 900, "V100-PCIe-16GB", "v100"),
    _S("V100 PCIe 32GB", ("v100", ), "pcie", 112.0, 0.0, 14.0, 32, 900, "V100-PCIe-32GB", "v100"),
    _S("V100S PCIe 32GB", ("v100s", ), "pcie", 130.0, 0.0, 16.4, 32, 1134, "V100S-32GB", "v100"),
    _S("T4", ("t4", ), "", 65.0, 0.0, 8.1, 16, 320, "T4", "t4"),
    _S("A10", ("a10", ), "", 125.0, 125.0, 31.2, 24, 600, "A10", "a10"),
    _S("L4", ("l4", ), "", 121.0, 121.0, 30.3, 24, 300, "L4", "l4"),
    _S("L40S", ("l40s", ), "", 362.0, 362.0, 91.6, 48, 864, "L40S", "l40s"),
    _S("A100 40GB SXM", ("a100", ), "", 312.0, 312.0, 19.5, 40, 1555, "A100-40GB", "a100"),
    _S("A100 80GB SXM", ("a100", ), "", 312.0, 312.0, 19.5, 80, 2039, "A100-80GB", "a100"),
    _S("A100 40GB PCIe", ("a100", ), "pcie", 312.0, 312.0, 19.5, 40, 1555, "A100-40GB-PCIe", "a100"),
    _S("A100 80GB PCIe", ("a100", ), "pcie", 312.0, 312.0, 19.5, 80, 1935, "A100-80GB-PCIe", "a100"),
    _S("H100 SXM", ("h100", ), "", 989.0, 989.0, 67.0, 80, 3350, "H100", "h100"),
    _S("H100 PCIe", ("h100", ), "pcie", 756.0, 756.0, 51.0, 80, 2000, "H100-PCIe", "h100"),
    _S("H100 NVL", ("h100", ), "nvl", 835.0, 835.0, 60.0, 94, 3900, "H100-NVL", "h100"),
    _S("H200 SXM", ("h200", ), "", 989.0, 989.0, 67.0, 141, 4800, "H200", "h200"),
    _S("H200 NVL", ("h200", ), "nvl", 835.0, 835.0, 60.0, 141, 4800, "H200-NVL", "h200"),
    _S("GeForce RTX 3090", ("3090", ), "", 71.0, 71.0, 35.6, 24, 936, "RTX-3090", "ga102"),
    _S("GeForce RTX 4090", ("4090", ), "", 165.2, 165.2, 82.6, 24, 1008, "RTX-4090", "ada"),
    _S("Instinct MI250X (one GCD)", ("mi250x", "mi250"), "", 191.5, 191.5, 47.9, 64, 1638, "MI250X", "mi250x"),
    _S("Instinct MI300X", ("mi300x", ), "", 1307.4, 1307.4, 163.4, 192, 5300, "MI300X", "mi300x"),
)

# Kinds a cluster description may name that a running job never looks up by device name: a CPU
# rank is measured at start-up (``device_benchmark.py``), whatever its model. One rank is one core
# (the fork's CPU ranks run one thread each); its memory is a share of the host's RAM, which a
# cluster description gives per device (``memory_gb``), and its bandwidth is the socket's over 64
# cores. No bf16/fp16 matrix unit on Zen 3: training runs fp32.
CPU_SPECS = (
    _S("AMD EPYC 7763, one core", (), "", 0.0, 0.0, 0.0784, 0, 3.2, "EPYC-7763-core", "epyc7763"),
)

DEVICE_KINDS = ACCELERATOR_SPECS + CPU_SPECS


def kind_names():
    """Every kind key, in table order."""
    return [spec.kind for spec in DEVICE_KINDS]


def find_kind(kind):
    """The entry whose ``kind`` is ``kind`` (case-insensitive), or None."""
    wanted = str(kind).strip().lower()
    for spec in DEVICE_KINDS:
        if spec.kind.lower() == wanted:
            return spec
    return None


def datasheet(spec):
    """``(document name, URL)`` of an entry's figures; ``("", "")`` for a kind given by numbers."""
    return DATASHEETS.get(spec.source, ("", ""))
