# SPDX-License-Identifier: Apache-2.0
"""Lossless coding of what crosses a slow link (``communication.compress_inter_host: "lossless"``).

A floating-point tensor's most significant byte holds its sign and the top of its exponent. In
weights, gradients and their partial sums the exponents cluster within a few octaves, so that byte
carries 2-4 bits of information in 8, while the mantissa bytes below it look random. The coder
sends the lower bytes as they are and entropy-codes the top byte plane (zlib's Huffman-only
deflate: no match search; 500-600 MB/s of tensor coded, about 850 MB/s decoded, on one core here):
an fp32 tensor of weights or gradients shrinks to about 0.83-0.86 of its bytes, a bf16 one to about
0.67, an fp16 one (5 exponent bits) to about 0.81-0.84. Decoding gives back the same bits, NaN
payloads, infinities, signed zeros and subnormals included, so a run with it is bitwise the run
without it.

A payload is self-describing given the dtype and the element count both sides already know:
``[lower bytes of every element, element-major][coded top plane][flag]``, or ``[raw bytes][flag]``
where coding would not shrink the plane (random bits, integer dtypes, tiny tensors). The flag is
the last byte, so a raw payload's body starts aligned. An empty tensor is an empty payload.

Sizes differ per message, so an exchange sends the payload sizes first (one small all-to-all of
int64 per exchange, ``exchange_sizes``) and the payloads after. The coding runs on the host's CPU;
a device tensor is copied to the host and back."""

import sys
import zlib

import torch

RAW, CODED = 0, 1
MIN_CODED_ELEMENTS = 256  # below this the header and the Huffman table outweigh the gain
_CODER_ARGS = (1, zlib.DEFLATED, -15, 9, zlib.Z_HUFFMAN_ONLY)  # raw deflate: no zlib header or checksum


def _codable(dtype, numel):
    return (dtype.is_floating_point and dtype.itemsize > 1 and sys.byteorder == "little"
            and numel >= MIN_CODED_ELEMENTS)


def encode(tensor):
    """The payload of ``tensor`` (any shape, contiguous or not): a 1-D uint8 tensor on the CPU."""
    flat = tensor.detach().resolve_conj().resolve_neg().reshape(-1).cpu().contiguous()
    n = flat.numel()
    if n == 0:
        return torch.empty(0, dtype=torch.uint8)
    size = flat.element_size()
    raw = flat.view(torch.uint8)
    if _codable(flat.dtype, n):
        planes = raw.view(n, size)
        coder = zlib.compressobj(*_CODER_ARGS)
        coded = coder.compress(planes[:, size - 1].contiguous().numpy()) + coder.flush()
        if len(coded) < n:
            low = n * (size - 1)
            payload = torch.empty(low + len(coded) + 1, dtype=torch.uint8)
            payload[:low].view(n, size - 1).copy_(planes[:, :size - 1])
            payload[low:-1].numpy()[:] = memoryview(coded)
            payload[-1] = CODED
            return payload
    payload = torch.empty(raw.numel() + 1, dtype=torch.uint8)
    payload[:-1].copy_(raw)
    payload[-1] = RAW
    return payload


def decode(payload, dtype, numel):
    """The tensor (1-D, ``numel`` elements of ``dtype``, on the CPU) that ``encode`` made
    ``payload`` from. A payload that does not fit raises ValueError."""
    if numel == 0:
        if payload.numel():
            raise ValueError(f"a payload of {payload.numel()} bytes for an empty tensor")
        return torch.empty(0, dtype=dtype)
    payload = payload.cpu()
    size = dtype.itemsize
    flag = int(payload[-1]) if payload.numel() else None
    if flag == RAW and payload.numel() == numel * size + 1:
        return payload[:-1].clone().view(dtype)
    low = numel * (size - 1)
    if flag != CODED or payload.numel() <= low + 1:
        raise ValueError(f"a payload of {payload.numel()} bytes (flag {flag}) does not hold {numel} elements "
                         f"of {dtype}")
    try:  # at most one byte past what fits, so a damaged payload cannot fill memory
        top = zlib.decompressobj(-15).decompress(payload[low:-1].numpy(), numel + 1)
    except zlib.error as exc:
        raise ValueError(f"a coded payload of {payload.numel()} bytes does not decode: {exc}") from None
    if len(top) != numel:
        raise ValueError(f"a coded payload decodes to {len(top)} top bytes, not {numel}")
    planes = torch.empty(numel, size, dtype=torch.uint8)
    planes[:, :size - 1].copy_(payload[:low].view(numel, size - 1))
    planes[:, size - 1].numpy()[:] = memoryview(top)
    return planes.view(dtype).view(-1)


def scope(stage, reduce_scatter=True):
    """What the setting codes under ZeRO ``stage``, for the start-up and status lines: it acts on
    the all-to-all exchanges between hosts, not on an all-reduce between them."""
    if stage == 0:
        return "inter-host lossless coding codes nothing here (ZeRO-0's all-reduce between hosts travels raw)"
    if stage < 3 and not reduce_scatter:
        return ("updated partitions coded losslessly between hosts (the gradient all-reduce of reduce_scatter "
                "false travels raw)")
    return "inter-host exchanges coded losslessly"


def exchange_sizes(sizes, group, device):
    """One all-to-all of ``sizes[r]`` (bytes this rank sends to rank r of ``group``); returns the
    sizes each rank sends to this one."""
    from deepspeed import comm as dist
    sent = torch.tensor(sizes, dtype=torch.int64, device=device)
    received = torch.empty_like(sent)
    dist.all_to_all_single(received, sent, group=group)
    return received.tolist()
