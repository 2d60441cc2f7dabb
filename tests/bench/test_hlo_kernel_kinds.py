"""bench.hlo_kernel_kinds groups two modules' loop kernels by kind and finds the work that
depends on the stacked weights alone."""
from bench.hlo_kernel_kinds import kinds, main
from tests.plan.test_plan_hlo import LOOP

# A 3-layer loop over stacked float32 weights w [3, 64, 64]: one fusion casts the layer's
# weight to FP8 (the weights alone), one takes the activation's amax (a reduction), and a
# Pallas kernel reads both.
QUANT_LOOP = """HloModule quant

%fused_cast (c0: f32[3,64,64], c1: s32[]) -> f8e4m3fn[64,64] {
  %c0 = f32[3,64,64]{2,1,0} parameter(0)
  %c1 = s32[] parameter(1)
  %z = s32[] constant(0)
  %s = f32[1,64,64]{2,1,0} dynamic-slice(%c0, %c1, %z, %z), dynamic_slice_sizes={1,64,64}
  %b = f32[64,64]{1,0} bitcast(%s)
  ROOT %q = f8e4m3fn[64,64]{1,0} convert(%b)
}

%max (l: f32[], r: f32[]) -> f32[] {
  %l = f32[] parameter(0)
  %r = f32[] parameter(1)
  ROOT %m = f32[] maximum(%l, %r)
}

%fused_amax (a0: bf16[32,64]) -> f32[] {
  %a0 = bf16[32,64]{1,0} parameter(0)
  %f = f32[32,64]{1,0} convert(%a0)
  %abs = f32[32,64]{1,0} abs(%f)
  %init = f32[] constant(0)
  ROOT %r = f32[] reduce(%abs, %init), dimensions={0,1}, to_apply=%max
}

%body (state: (s32[], bf16[32,64], f32[3,64,64])) -> (s32[], bf16[32,64], f32[3,64,64]) {
  %state = (s32[], bf16[32,64]{1,0}, f32[3,64,64]{2,1,0}) parameter(0)
  %i = s32[] get-tuple-element(%state), index=0
  %x = bf16[32,64]{1,0} get-tuple-element(%state), index=1
  %w = f32[3,64,64]{2,1,0} get-tuple-element(%state), index=2
  %wq = f8e4m3fn[64,64]{1,0} fusion(%w, %i), kind=kLoop, calls=%fused_cast
  %amax = f32[] fusion(%x), kind=kInput, calls=%fused_amax
  %k = bf16[32,64]{1,0} custom-call(%x, %wq, %amax), custom_call_target="mosaic_gpu_v2"
  ROOT %t = (s32[], bf16[32,64]{1,0}, f32[3,64,64]{2,1,0}) tuple(%i, %k, %w)
}

%cond (c: (s32[], bf16[32,64], f32[3,64,64])) -> pred[] {
  %c = (s32[], bf16[32,64]{1,0}, f32[3,64,64]{2,1,0}) parameter(0)
  %ci = s32[] get-tuple-element(%c), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%ci, %n), direction=LT
}

ENTRY %main (x0: bf16[32,64], w0: f32[3,64,64]) -> bf16[32,64] {
  %x0 = bf16[32,64]{1,0} parameter(0)
  %w0 = f32[3,64,64]{2,1,0} parameter(1)
  %zero = s32[] constant(0)
  %init = (s32[], bf16[32,64]{1,0}, f32[3,64,64]{2,1,0}) tuple(%zero, %x0, %w0)
  %loop = (s32[], bf16[32,64]{1,0}, f32[3,64,64]{2,1,0}) while(%init), condition=%cond, body=%body, \
backend_config={"known_trip_count":{"n":"3"}}
  ROOT %out = bf16[32,64]{1,0} get-tuple-element(%loop), index=1
}
"""


def test_kinds_name_custom_calls_and_fusions_and_count_weight_only_work_per_layer():
    counts, weights = kinds(QUANT_LOOP)
    assert counts == {"fusion convert +8-bit": 3, "fusion reduce": 3, "custom-call mosaic_gpu_v2": 3,
                      "compare": 3}  # the loop condition's
    assert weights == 3  # the cast of the stacked weight; the amax reads the activation


def test_a_loop_without_stacked_weights_has_no_weight_only_kernels():
    counts, weights = kinds(LOOP)
    # Its update of the f32[4, ...] buffer reads the GEMM's output too.
    assert sum(counts.values()) == 12 and weights == 0


def test_the_command_prints_the_difference_first(tmp_path, capsys):
    base, other = tmp_path / "base.hlo.txt", tmp_path / "other.hlo.txt"
    base.write_text(LOOP)
    other.write_text(QUANT_LOOP)
    assert main([str(base), str(other)]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert rows[0].startswith("| custom-call mosaic_gpu_v2 | 0 | 3 | +3 |")
    assert "| of which weight-only | 0 | 3 | +3 |" in out
