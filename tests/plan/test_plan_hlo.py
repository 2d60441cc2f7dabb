"""The plan's HLO counter on hand-written modules whose answers are known: a dot, a fusion,
a loop of 4, an in-place update of a slice, a collective."""
import pytest

from lp_jax.plan.gpus import GPUS
from lp_jax.plan.hlo_module import Module, shape_bytes
from lp_jax.plan.kernels import kernels
from lp_jax.plan.roofline import GEMM_EFFICIENCY, HBM_EFFICIENCY, LAUNCH_S, estimate

DOT = """HloModule dot

ENTRY %main (a: bf16[64,128], b: bf16[128,256]) -> f32[64,256] {
  %a = bf16[64,128]{1,0} parameter(0)
  %b = bf16[128,256]{1,0} parameter(1)
  ROOT %dot.1 = f32[64,256]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""

FUSION = """HloModule fusion

%fused_mul (p0: f32[1024], p1: f32[1024]) -> bf16[1024] {
  %p0 = f32[1024]{0} parameter(0)
  %p1 = f32[1024]{0} parameter(1)
  %m = f32[1024]{0} multiply(%p0, %p1)
  ROOT %c = bf16[1024]{0} convert(%m)
}

ENTRY %main (x: f32[1024], y: f32[1024]) -> bf16[1024] {
  %x = f32[1024]{0} parameter(0)
  %y = f32[1024]{0} parameter(1)
  ROOT %f = bf16[1024]{0} fusion(%x, %y), kind=kLoop, calls=%fused_mul
}
"""

LOOP = """HloModule loop

%fused_gemm (g0: bf16[32,64], g1: bf16[64,64]) -> f32[32,64] {
  %g0 = bf16[32,64]{1,0} parameter(0)
  %g1 = bf16[64,64]{1,0} parameter(1)
  ROOT %d = f32[32,64]{1,0} dot(%g0, %g1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_update (u0: f32[4,32,64], u1: f32[32,64], u2: s32[]) -> f32[4,32,64] {
  %u0 = f32[4,32,64]{2,1,0} parameter(0)
  %u1 = f32[32,64]{1,0} parameter(1)
  %u2 = s32[] parameter(2)
  %r = f32[1,32,64]{2,1,0} bitcast(%u1)
  %z = s32[] constant(0)
  ROOT %dus = f32[4,32,64]{2,1,0} dynamic-update-slice(%u0, %r, %u2, %z, %z)
}

%body (state: (s32[], bf16[32,64], bf16[64,64], f32[4,32,64])) -> (s32[], bf16[32,64], bf16[64,64], f32[4,32,64]) {
  %state = (s32[], bf16[32,64]{1,0}, bf16[64,64]{1,0}, f32[4,32,64]{2,1,0}) parameter(0)
  %i = s32[] get-tuple-element(%state), index=0
  %x = bf16[32,64]{1,0} get-tuple-element(%state), index=1
  %w = bf16[64,64]{1,0} get-tuple-element(%state), index=2
  %buf = f32[4,32,64]{2,1,0} get-tuple-element(%state), index=3
  %gemm = f32[32,64]{1,0} fusion(%x, %w), kind=kCustom, calls=%fused_gemm, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}
  %upd = f32[4,32,64]{2,1,0} fusion(%buf, %gemm, %i), kind=kLoop, calls=%fused_update
  ROOT %t = (s32[], bf16[32,64]{1,0}, bf16[64,64]{1,0}, f32[4,32,64]{2,1,0}) tuple(%i, %x, %w, %upd)
}

%cond (c: (s32[], bf16[32,64], bf16[64,64], f32[4,32,64])) -> pred[] {
  %c = (s32[], bf16[32,64]{1,0}, bf16[64,64]{1,0}, f32[4,32,64]{2,1,0}) parameter(0)
  %ci = s32[] get-tuple-element(%c), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%ci, %n), direction=LT
}

ENTRY %main (x0: bf16[32,64], w0: bf16[64,64], b0: f32[4,32,64]) -> f32[4,32,64] {
  %x0 = bf16[32,64]{1,0} parameter(0)
  %w0 = bf16[64,64]{1,0} parameter(1)
  %b0 = f32[4,32,64]{2,1,0} parameter(2)
  %zero = s32[] constant(0)
  %init = (s32[], bf16[32,64]{1,0}, bf16[64,64]{1,0}, f32[4,32,64]{2,1,0}) tuple(%zero, %x0, %w0, %b0)
  %loop = (s32[], bf16[32,64]{1,0}, bf16[64,64]{1,0}, f32[4,32,64]{2,1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
  ROOT %out = f32[4,32,64]{2,1,0} get-tuple-element(%loop), index=3
}
"""

COLLECTIVE = """HloModule ar

%add (l: f32[], r: f32[]) -> f32[] {
  %l = f32[] parameter(0)
  %r = f32[] parameter(1)
  ROOT %s = f32[] add(%l, %r)
}

ENTRY %main (g: f32[1024,1024]) -> f32[1024,1024] {
  %g = f32[1024,1024]{1,0} parameter(0)
  %ars = f32[1024,1024]{1,0} all-reduce-start(%g), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
  ROOT %ard = f32[1024,1024]{1,0} all-reduce-done(%ars)
}
"""


ALL_TO_ALL = """HloModule a2a

ENTRY %main (x: bf16[8,1024,256]) -> bf16[8,1024,256] {
  %x = bf16[8,1024,256]{2,1,0} parameter(0)
  %a2as = ((bf16[8,1024,256]{2,1,0}), bf16[8,1024,256]{2,1,0}) all-to-all-start(%x), replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  ROOT %a2ad = bf16[8,1024,256]{2,1,0} all-to-all-done(%a2as)
}
"""


def test_an_async_all_to_all_is_one_collective_and_its_done_moves_no_hbm_bytes():
    (k,) = kernels(Module.parse(ALL_TO_ALL), device_count=8)
    assert k.name == "a2as" and k.collective == "all-to-all" and k.is_async and k.bytes == 8 * 1024 * 256 * 2
    assert estimate([k], GPUS["gb200"], 8).hbm_bytes == 0


def test_shapes_count_their_bytes_and_pack_four_bit_types():
    assert shape_bytes("bf16[64,128]{1,0}") == 64 * 128 * 2
    assert shape_bytes("(f32[8]{0}, u8[0]{0})") == 32
    assert shape_bytes("f4e2m1fn[32,16]{1,0}") == 256


def test_a_dot_is_one_gemm_with_its_flops_and_bytes():
    (k,) = kernels(Module.parse(DOT))
    assert k.library == "xla" and k.operand_type == "bf16" and k.runs == 1
    assert k.flops == 2 * 64 * 256 * 128
    assert k.bytes == 64 * 128 * 2 + 128 * 256 * 2 + 64 * 256 * 4


def test_a_fusion_is_one_kernel_reading_its_operands_once():
    (k,) = kernels(Module.parse(FUSION))
    assert k.library is None and k.flops == 0 and k.bytes == 2 * 1024 * 4 + 1024 * 2


def test_a_loop_of_four_counts_its_body_four_times_and_a_slice_update_in_place():
    module = Module.parse(LOOP)
    assert module.runs() == {"main": 1, "body": 4, "cond": 4} and module.trip_counts() == [4]
    by_name = {k.name: k for k in kernels(module)}
    gemm, update = by_name["gemm"], by_name["upd"]
    assert gemm.runs == 4 and gemm.library == "triton" and gemm.flops == 2 * 32 * 64 * 64
    # The update writes one [32, 64] slice of the [4, 32, 64] buffer and reads the new slice
    # and the index: not the buffer.
    assert update.runs == 4 and update.bytes == 32 * 64 * 4 * 2 + 4
    assert by_name["lt"].runs == 4 and "loop" not in by_name  # the while itself launches nothing
    assert module.looped() == {"body", "cond"} and all(k.looped for k in by_name.values())
    assert not any(k.looped for k in kernels(Module.parse(DOT)))


def test_an_async_all_reduce_counts_once_and_overlaps_with_compute():
    (k,) = kernels(Module.parse(COLLECTIVE), device_count=8)
    assert k.collective == "all-reduce" and k.is_async and k.group_size == 8 and k.bytes == 4 * 2 ** 20
    est = estimate([k], GPUS["h200"], 8)
    wire = 2 * 7 / 8 * 4 * 2 ** 20
    assert est.collective_s == pytest.approx(wire / 450e9) and est.exposed_collective_s == est.collective_s


def test_the_roofline_takes_the_slower_of_flops_and_bytes_per_kernel():
    gpu = GPUS["b200"]
    (k,) = kernels(Module.parse(DOT))
    est = estimate([k], gpu, 1)
    expected = max(k.flops / (GEMM_EFFICIENCY * gpu.peak("bf16") * 1e12),
                   k.bytes / (HBM_EFFICIENCY * gpu.hbm_bytes_per_s)) + LAUNCH_S
    assert est.step_s == pytest.approx(expected) and est.gemms == {"xla": 1}
    assert gpu.peak("fp4") == 9000.0 and GPUS["h200"].peak("fp4") == GPUS["h200"].peak("bf16")


def test_the_gpu_target_names_its_compute_capability_and_cudnn():
    text = GPUS["b200"].target_config()
    assert "cuda_compute_capability { major: 10 minor: 0 }" in text and 'dnn_version: "9.10.0"' in text
    assert "core_count: 148" in text and "NVIDIA B200" in text


ASYNC_SLICE_UPDATE = """HloModule async_update

%fused_update (a0: bf16[8,256], a1: f32[1,512], a2: s32[]) -> bf16[8,256] {
  %a0 = bf16[8,256]{1,0} parameter(0)
  %a1 = f32[1,512]{1,0} parameter(1)
  %c = bf16[1,512]{1,0} convert(%a1)
  %half = bf16[1,256]{1,0} slice(%c), slice={[0:1], [0:256]}
  %a2 = s32[] parameter(2)
  %z = s32[] constant(0)
  ROOT %dus = bf16[8,256]{1,0} dynamic-update-slice(%a0, %half, %a2, %z)
}

ENTRY %main (buf: bf16[8,256], x: f32[1,512], i: s32[]) -> bf16[8,256] {
  %buf = bf16[8,256]{1,0} parameter(0)
  %x = f32[1,512]{1,0} parameter(1)
  %i = s32[] parameter(2)
  %start = ((bf16[8,256]{1,0}, f32[1,512]{1,0}, s32[]), bf16[8,256]{1,0}, u32[]) fusion-start(%buf, %x, %i), kind=kLoop, calls=%fused_update
  ROOT %done = bf16[8,256]{1,0} fusion-done(%start)
}
"""


def test_an_async_fusion_is_one_kernel_that_moves_its_slices():
    """XLA's fusion-start/fusion-done pair is one launch; it writes the row it updates and
    reads only the half of x its slice takes (through the convert), not the whole buffer."""
    (k,) = kernels(Module.parse(ASYNC_SLICE_UPDATE))
    assert k.opcode == "fusion-start" and k.runs == 1
    assert k.bytes == 256 * 4 + 4 + 256 * 2  # x's sliced half in f32, the index, the row written


BITCAST_SLICE_UPDATE = """HloModule bitcast_update

%fused_update (g: f32[64,1,32], buf: f32[8,32,64], i: s32[]) -> f32[64,8,32] {
  %buf = f32[8,32,64]{1,0,2} parameter(1)
  %view = f32[64,8,32]{2,1,0} bitcast(%buf)
  %g = f32[64,1,32]{2,1,0} parameter(0)
  %i = s32[] parameter(2)
  %z = s32[] constant(0)
  ROOT %dus = f32[64,8,32]{2,1,0} dynamic-update-slice(%view, %g, %z, %i, %z)
}

ENTRY %main (g: f32[64,1,32], buf: f32[8,32,64], i: s32[]) -> f32[64,8,32] {
  %g = f32[64,1,32]{2,1,0} parameter(0)
  %buf = f32[8,32,64]{1,0,2} parameter(1)
  %i = s32[] parameter(2)
  ROOT %update = f32[64,8,32]{2,1,0} fusion(%g, %buf, %i), kind=kLoop, calls=%fused_update
}
"""


def test_a_slice_update_through_a_bitcast_of_the_buffer_is_in_place():
    """A stacked weight gradient whose layout puts the layer axis inside is bitcast before
    the update; the kernel still writes one layer's slice, not the whole buffer."""
    (k,) = kernels(Module.parse(BITCAST_SLICE_UPDATE))
    assert k.bytes == 64 * 32 * 4 + 4 + 64 * 32 * 4  # the slice read, the index, the slice written


READ_MODIFY_WRITE = """HloModule read_modify_write

%fused_update (buf: bf16[4096,64], w: bf16[128,64], i: s32[], keep: pred[128,64]) -> bf16[4096,64] {
  %buf = bf16[4096,64]{1,0} parameter(0)
  %w = bf16[128,64]{1,0} parameter(1)
  %i = s32[] parameter(2)
  %keep = pred[128,64]{1,0} parameter(3)
  %z = s32[] constant(0)
  %old = bf16[128,64]{1,0} dynamic-slice(%buf, %i, %z), dynamic_slice_sizes={128,64}
  %new = bf16[128,64]{1,0} select(%keep, %w, %old)
  ROOT %dus = bf16[4096,64]{1,0} dynamic-update-slice(%buf, %new, %i, %z)
}

%fused_elsewhere (buf: bf16[4096,64], w: bf16[128,64], i: s32[], j: s32[]) -> bf16[4096,64] {
  %buf = bf16[4096,64]{1,0} parameter(0)
  %w = bf16[128,64]{1,0} parameter(1)
  %i = s32[] parameter(2)
  %j = s32[] parameter(3)
  %z = s32[] constant(0)
  %old = bf16[128,64]{1,0} dynamic-slice(%buf, %j, %z), dynamic_slice_sizes={128,64}
  %new = bf16[128,64]{1,0} add(%w, %old)
  ROOT %dus = bf16[4096,64]{1,0} dynamic-update-slice(%buf, %new, %i, %z)
}

ENTRY %main (buf: bf16[4096,64], w: bf16[128,64], i: s32[], keep: pred[128,64], j: s32[]) -> bf16[4096,64] {
  %buf = bf16[4096,64]{1,0} parameter(0)
  %w = bf16[128,64]{1,0} parameter(1)
  %i = s32[] parameter(2)
  %keep = pred[128,64]{1,0} parameter(3)
  %j = s32[] parameter(4)
  %same = bf16[4096,64]{1,0} fusion(%buf, %w, %i, %keep), kind=kLoop, calls=%fused_update
  ROOT %other = bf16[4096,64]{1,0} fusion(%same, %w, %i, %j), kind=kLoop, calls=%fused_elsewhere
}
"""


def test_a_window_read_and_written_back_in_place_counts_the_window():
    """A fusion that reads a window of a buffer and writes it back at the same indices runs in
    place on GPUs (XLA's in-place dynamic-update-slice emitter): it moves the window twice,
    not the buffer. Read at other indices, the buffer counts whole."""
    same, other = kernels(Module.parse(READ_MODIFY_WRITE))
    window = 128 * 64 * 2
    assert same.bytes == window + window + 4 + 128 * 64 + window  # old slice, w, i, keep, slice written
    assert other.bytes == 4096 * 64 * 2 + window + 4 + 4 + window


def _conditional(op_name):
    return f"""HloModule cond

%small (s: bf16[128,64]) -> f32[128,64] {{
  %s = bf16[128,64]{{1,0}} parameter(0)
  ROOT %d = f32[128,64]{{1,0}} dot(%s, %s), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
}}

%large (l: bf16[512,64]) -> f32[128,64] {{
  %l = bf16[512,64]{{1,0}} parameter(0)
  %d = f32[512,64]{{1,0}} dot(%l, %l), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
  ROOT %s = f32[128,64]{{1,0}} slice(%d), slice={{[0:128], [0:64]}}
}}

ENTRY %main (i: s32[], a: bf16[128,64], b: bf16[512,64]) -> f32[128,64] {{
  %i = s32[] parameter(0)
  %a = bf16[128,64]{{1,0}} parameter(1)
  %b = bf16[512,64]{{1,0}} parameter(2)
  ROOT %c = f32[128,64]{{1,0}} conditional(%i, %a, %b), branch_computations={{%small, %large}}, metadata={{op_name="{op_name}"}}
}}
"""


def test_a_conditional_counts_every_branch_unless_it_names_the_expected_one():
    """Which branch runs is data: each counts (a bound), unless the conditional was traced
    under lp_expected_branch_<i> (lp.ragged_dot names the window of an even share)."""
    every = Module.parse(_conditional("jit(f)/cond")).runs()
    assert every["small"] == every["large"] == 1
    expected = Module.parse(_conditional("jit(f)/transpose(jvp(lp_expected_branch_0))/cond"))
    assert expected.runs().get("large", 0) == 0 and expected.runs()["small"] == 1
    assert [k.flops for k in kernels(expected) if k.flops] == [2 * 128 * 64 * 64]  # small only
