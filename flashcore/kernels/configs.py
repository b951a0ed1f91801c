"""Launch configurations of every attention kernel: block sizes, warps, pipeline stages, registers and the number
of KV splits, keyed by shape.

Everything here is a pure function of host-side shapes (never of ``seq_lens`` values, which live on the
device), so a choice is stable across decode steps and safe to make during CUDA-graph capture.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from flashcore.backends import per_device

LOG2_E = 1.4426950408889634  # exp(x) == exp2(x * log2(e)): every kernel takes scale * LOG2_E and uses exp2

# The interpreter has no SMs. Pretending to have a few makes the small shapes of the CPU test suite take the
# split-KV path as well as the single-pass path.
INTERPRETER_NUM_SMS = 8
# Nor an L2: a small stand-in makes the test shapes run the launch order with several groups, the last one short.
INTERPRETER_L2_BYTES = 32 * 1024
# One BLOCK_N tile: a shorter split would only add partial writes to the merge.
MIN_TOKENS_PER_SPLIT = 64
MAX_KV_SPLITS = 64
# Calls with at most this many new tokens load them as one K/V tile before the cached prefix (new_tokens_tile).
NEW_TOKENS_TILE = 16
# fp32 elements of partial outputs one merge step holds: 64 registers per thread at 4 warps.
MERGE_TILE_ELEMENTS = 8192


@dataclass(frozen=True)
class GluonDecodeConfig:
    """The Gluon sm_90 decode kernel's fixed launch settings (its keys per tile: :func:`gluon_decode_block_n`)."""

    head_dims: tuple[int, ...] = (64, 128)  # the head dims measured and tested on the H100
    block_m: int = 16  # one mma.sync row tile: the GQA group, padded
    num_stages: int = 2  # 3 stages were slower on every split row on the H100 (NOTES.md, entry 30)
    num_consumer_warps: int = 4
    # Registers per thread at launch: 2 programs of (4 consumer + 4 producer-group) warps per SM. The producer warp
    # gives all but 24 back (setmaxnreg), so the consumers may use up to 232.
    max_registers: int = 128


@dataclass(frozen=True)
class GluonPrefillConfig:
    """The Gluon sm_90 prefill kernel's fixed launch settings."""

    head_dims: tuple[int, ...] = (64, 128)
    block_m: int = 128  # query rows per program, 64 per consumer warpgroup
    block_n: int = 128
    num_stages: int = 2
    min_new_tokens: int = 128  # a chunk smaller than one query block is decode-like: the Triton kernel takes it
    # 12 warps (two consumer warpgroups and the producer's group) at 168 registers fill the register file; the
    # producer gives all but 24 back, so the consumers may hold 232-248.
    max_registers: int = 168


GLUON_DECODE = GluonDecodeConfig()
GLUON_PREFILL = GluonPrefillConfig()


@dataclass(frozen=True)
class AttentionConfig:
    block_m: int  # rows of the packed (query token x query head in the group) dimension
    block_n: int  # keys per tile
    num_warps: int
    num_stages: int
    kv_splits: int = 0  # 0: as many as fill the SMs (num_kv_splits)


def head_dim_padded(head_dim: int) -> int:
    # tl.dot needs every dimension >= 16, and tl.arange a power of two.
    return max(16, triton.next_power_of_2(head_dim))


def attention_config(
    packed_rows: int, head_dim: int, batch_kv_heads: int, element_bytes: int, device: torch.device
) -> AttentionConfig:
    """Decode-like calls (few packed rows) use one small M tile and stream K/V; prefill uses FA2-size tiles.

    ``packed_rows = S_q * group``: the new tokens times the query heads that share one KV head.
    """
    head_dim_pad = head_dim_padded(head_dim)
    row_bytes = head_dim_pad * element_bytes  # one K or V row in shared memory
    if packed_rows <= 64:
        block_m = max(16, triton.next_power_of_2(packed_rows))
        # GQA decode with three or more programs per SM: fewer registers and less shared memory per program
        # keep more of them, and more loads, in flight. H100 (NOTES.md, entries 14 and 22): at D 128, one-warp
        # programs with two KV splits each were faster at B64 L1k, from behind SDPA to ahead of it, and level at
        # L4k and L32k. At B32 (1.9 programs per SM) the same config gained a little under graph replay but took
        # the split path's host cost, above SDPA's per eager call then (before the launcher fix of entry 23; not
        # re-measured since), so it stays below this line. Other head dims keep 4 warps with BLOCK_N 32 (SmolLM2's
        # D 64 lost with one warp at B64 L4k); MHA lost with BLOCK_N 32 (B32 L4k), and so did GQA with fewer
        # programs.
        is_many_gqa_programs = packed_rows > 1 and batch_kv_heads >= 3 * num_sms(device)
        if is_many_gqa_programs and head_dim_pad == 128:
            return AttentionConfig(block_m=block_m, block_n=32, num_warps=1, num_stages=2, kv_splits=2)
        block_n = 32 if is_many_gqa_programs or head_dim_pad > 128 else 64
        # fp32 at head dim 256 (1 KB rows): a 64-row Q tile, the new tokens' K/V tile and 3 K/V stages needed 232 KB
        # of shared memory, past the H100's 227 KB (NOTES.md, entry 28); 2 stages fit.
        num_stages = 2 if row_bytes > 512 else 3
        return AttentionConfig(block_m=block_m, block_n=block_n, num_warps=4, num_stages=num_stages)
    if head_dim_pad <= 64:
        return AttentionConfig(block_m=128, block_n=64, num_warps=4, num_stages=3)
    if head_dim_pad <= 128:
        # fp32 (512 B rows) with the new tokens' tile: 246 KB with 3 stages (NOTES.md, entry 28); 2 stages fit.
        return AttentionConfig(block_m=128, block_n=64, num_warps=8, num_stages=2 if row_bytes > 256 else 3)
    # head_dim 256: a 128x256 Q tile plus double-buffered K/V tiles must fit in shared memory.
    return AttentionConfig(block_m=64, block_n=32, num_warps=8, num_stages=2)


def new_tokens_tile(num_new: int) -> int:
    """Keys in the one tile that holds all of a call's new tokens, or 0 where they need the tiled loop.

    With few new tokens (decode), the kernel loads their K/V before streaming the cached prefix and attends to
    them after it, so the load's latency overlaps the stream. H100 graph replay, same run (NOTES.md, entry 27):
    faster at B32 L1k, B1 L32k and smol B64 L4k. 16 is the smallest tile
    ``tl.dot`` takes; more new tokens than that take the loop, whose tiles are pipelined.
    """
    return NEW_TOKENS_TILE if num_new <= NEW_TOKENS_TILE else 0


def rows_per_launch_group(
    num_rows: int, num_m_blocks: int, capacity: int, head_dim: int, element_bytes: int, device: torch.device
) -> int:
    """How many (batch, KV head) rows the attention kernel's launch order interleaves (its ``rows_per_group``).

    Within a group, each row's M blocks start heaviest first, all rows of the group abreast; groups run one after
    another. All rows in one group shortens the causal tail wave most, but once the K/V that the running programs
    stream outgrow L2, tiles that later M blocks of a row will read again are evicted. So a group holds as many
    rows as fit in half of L2. H100 prefill, B1 32/8 D128, same run (NOTES.md, entry 24), against M-major order:
    S2k gained with all 8 rows in one group (8 MB); at S32k (128 MB) one row per group was faster than all 8.
    """
    if num_m_blocks == 1:
        return num_rows  # decode: the order is the identity whatever the group
    kv_bytes_per_row = 2 * capacity * head_dim * element_bytes
    return max(1, min(num_rows, l2_bytes(device) // 2 // kv_bytes_per_row))


@per_device
def l2_bytes(device: torch.device) -> int:
    if device.type != "cuda":
        return INTERPRETER_L2_BYTES
    return torch.cuda.get_device_properties(device).L2_cache_size


@per_device
def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return INTERPRETER_NUM_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def num_kv_splits(num_programs: int, capacity: int, device: torch.device, wanted: int = 0) -> int:
    """FA3's idea: the fewest splits of the cached prefix that fill the SMs in one wave (or ``wanted``, a
    config's own choice), and never a split shorter than one key tile.

    Rounded down: a second, partial wave costs more than the SMs left idle (H100, B8 L4k decode: 2 splits =
    128 programs were faster than 3; NOTES.md, entry 3). The real lengths are on the device, so the cache
    capacity ``S_max`` bounds the work instead; splits of a short row end early and merge as empty.
    """
    sms = num_sms(device)
    splits_worth_it = max(1, capacity // MIN_TOKENS_PER_SPLIT)
    if wanted:
        return min(wanted, splits_worth_it)
    if num_programs >= sms:
        return 1
    splits_to_fill = sms // num_programs
    return min(splits_to_fill, splits_worth_it, MAX_KV_SPLITS)


def gluon_decode_kv_splits(num_programs: int, capacity: int, device: torch.device) -> int:
    """The Gluon decode kernel's KV splits: :func:`num_kv_splits`'s one wave, except where that is one split and
    the programs leave some SMs empty but fill more than half (``num_programs`` in (SMs / 2, SMs]): there two
    splits, two programs to most SMs, as the kernel's registers allow (``GluonDecodeConfig.max_registers``). Each SM
    then streams two programs' tiles at once; the merge costs a launch under capture, or the last split's merge in
    the launch when eager.

    H100, a B=16 replayed decode step on the Llama-3.2-1B shape (8 KV heads: 128 programs, 512-1044 keys; NOTES.md,
    entry 86): two splits merged in a second launch 8-12 µs a step faster than one split, 17-19 µs with the 128-key
    tiles of :func:`gluon_decode_block_n`; three or four splits (more programs than fit at once) 19-24 µs slower,
    and two merged in the attention launch 26-33 µs slower.
    """
    splits = num_kv_splits(num_programs, capacity, device)
    if splits == 1 and num_programs <= num_sms(device):
        return num_kv_splits(num_programs, capacity, device, wanted=2)
    return splits


def gluon_decode_block_n(head_dim: int, num_programs: int, num_splits: int, capacity: int, device: torch.device) -> int:
    """Keys per K/V tile of the Gluon decode kernel: 64, a 16 KiB tile at D 128; at D 64, 128 keys (the same 16 KiB)
    where the rows' programs, before splitting, are at most one per SM, and the larger tile leaves every split of a
    full cache as long as it was (a split ends on a tile boundary). Split, those programs fill one wave, one to an
    SM, or two to most SMs (:func:`gluon_decode_kv_splits`).

    Why only there. A program alone on its SM pays a barrier handoff per tile that no other program hides, so
    halving the tiles helps; where programs share an SM they hide each other's, and the 8 KiB tile was faster.
    And a split shorter than 128 keys would run past its end in 128-key steps, leaving splits idle. H100, graph
    replay, SmolLM2's 9/3 heads (benchmarks/NOTES.md, entry 33), 128 keys against 64: faster at B1 L4k, B8 L4k,
    B1 L32k, B16 L1k and B32 L1k; slower at B1 L1k (splits of 64 keys) and B64 L4k (192 programs). At D 128 a
    128-key tile (32 KiB) was slower on 5 of the 6 one-wave rows tried (entry 33). Two splits two to an SM are the
    exception to the sharing rule: 128 keys were 9 µs a step faster than 64 in a B=16 step on the Llama-3.2-1B shape
    (entry 86).
    """
    split_keys = -(-capacity // num_splits)
    keeps_splits = -(-split_keys // 64) % 2 == 0  # the split, in 64-key tiles, is a whole number of 128-key ones
    if head_dim == 64 and num_programs <= num_sms(device) and keeps_splits:
        return 128
    return 64


def merge_rows(packed_rows: int, block_m: int, splits_pad: int, head_dim_pad: int) -> int:
    """Packed rows the split merge combines per step: a whole decode tile (one GQA group) at once where its
    ``[rows, splits, D]`` partials fit in ``MERGE_TILE_ELEMENTS``, fewer rows per step where they do not."""
    rows_that_fit = max(1, MERGE_TILE_ELEMENTS // (splits_pad * head_dim_pad))
    rows_that_fit = 1 << (rows_that_fit.bit_length() - 1)  # tl.arange needs a power of two
    return min(triton.next_power_of_2(min(packed_rows, block_m)), rows_that_fit)
