"""Probe (issue 20, NVFP4): does TensorRT-RTX's ahead-of-time builder accept an NVFP4 GEMM without a GPU?

One MatMul y = x @ W^T: W as FLOAT4E2M1 values with FLOAT8E4M3FN scales per block of 16 along K and an fp16
global scale (DequantizeLinear twice), x through TensorRT's `trt::TRT_FP4DynamicQuantize` (FP4 values, FP8
block scales) and the same two DequantizeLinears. Measured here (tensorrt-rtx of the venv, no GPU):
SM120 / SM121 build (~277 KB plan); SM89 / SM86 are refused ("HW-specific datatypes: fp4_e2m1"). The
activations' global scale must be an initializer (the parser refuses one computed in the graph: "Scale input
must be an initializer"), so an NVFP4 engine needs per-layer activation calibration: why precast does not
build one yet. Usage: .venv/bin/python benchmarks/nvfp4_probe.py SM120
"""
import os, sys, tempfile, ml_dtypes, numpy as np, onnx, tensorrt_rtx as trt
from onnx import TensorProto as TP, helper, numpy_helper
M, K, N, B = 32, 128, 64, 16                                   # y[M,N] = x[M,K] @ W[N,K]^T, blocks of 16 along K
w = np.random.default_rng(0).standard_normal((N, K)).astype(np.float32)
gs = np.abs(w).max() / 6 / 448                                 # weight global scale
sf8 = (np.abs(w.reshape(N, K // B, B)).max(-1) / 6 / gs).astype(ml_dtypes.float8_e4m3fn)
wf4 = (w.reshape(N, K // B, B) / (sf8.astype(np.float32)[..., None] * gs)).reshape(N, K).astype(ml_dtypes.float4_e2m1fn)
nib = wf4.view(np.uint8).reshape(-1) & 15
f4 = helper.make_tensor("w_f4", TP.FLOAT4E2M1, [N, K], (nib[0::2] | nib[1::2] << 4).astype(np.uint8).tobytes(), raw=True)
inits = [f4, helper.make_tensor("w_sf8", TP.FLOAT8E4M3FN, [N, K // B], sf8.view(np.uint8).tobytes(), raw=True),
         numpy_helper.from_array(np.array(gs, np.float16), "w_gs"),
         numpy_helper.from_array(np.array(4 / 6 / 448, np.float32), "x_gs32"),     # activation global scale, fp32
         numpy_helper.from_array(np.array(4 / 6 / 448, np.float16), "x_gs")]
nodes = [helper.make_node("TRT_FP4DynamicQuantize", ["x", "x_gs32"], ["x_f4", "x_sf8"], domain="trt",
                          axis=-1, block_size=B, scale_type=TP.FLOAT8E4M3FN),
         helper.make_node("DequantizeLinear", ["x_sf8", "x_gs"], ["x_s"]),
         helper.make_node("DequantizeLinear", ["x_f4", "x_s"], ["x_dq"], axis=-1, block_size=B),
         helper.make_node("DequantizeLinear", ["w_sf8", "w_gs"], ["w_s"]),
         helper.make_node("DequantizeLinear", ["w_f4", "w_s"], ["w_dq"], axis=-1, block_size=B),
         helper.make_node("Transpose", ["w_dq"], ["w_t"], perm=[1, 0]),
         helper.make_node("MatMul", ["x_dq", "w_t"], ["y"])]
g = helper.make_graph(nodes, "nvfp4", [helper.make_tensor_value_info("x", TP.FLOAT16, [M, K])],
                      [helper.make_tensor_value_info("y", TP.FLOAT16, [M, N])], inits)
path = os.path.join(tempfile.mkdtemp(), "nvfp4.onnx")
onnx.save_model(helper.make_model(g, opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid("trt", 1)]), path)
class Log(trt.ILogger):
    def __init__(self): trt.ILogger.__init__(self)
    def log(self, sev, msg):
        if sev <= trt.ILogger.Severity.ERROR and "driver version is insufficient" not in msg: print(msg)
builder = trt.Builder(Log()); network = builder.create_network(0); parser = trt.OnnxParser(network, Log())
assert parser.parse_from_file(path), [parser.get_error(i).desc() for i in range(parser.num_errors)]
config = builder.create_builder_config(); config.num_compute_capabilities = 1
config.set_compute_capability(getattr(trt.ComputeCapability, sys.argv[1]), 0)
plan = builder.build_serialized_network(network, config)
print(sys.argv[1], "built", plan.nbytes if plan is not None else "FAILED")
