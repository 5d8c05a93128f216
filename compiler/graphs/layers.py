"""The layers every graph builder composes, as methods of the graph (compiler/graphs/onnx_graph.py's Graph).

Owns: Linear (and its forms over slices of the weight: chunks, row blocks, input columns), Conv, the
normalisations (group, layer, RMS; computed in fp32), activations, nearest upsampling and attention
written as MatMul/Softmax (scores and softmax in fp32). Each binds its weights by module name and checks
them against the tensor it meets (width, channels), so a damaged or foreign checkpoint is one line naming
the weight.
"""
from __future__ import annotations

import numpy as np

from ..errors import BadInput


class Layers:
    """Mixed into Graph: uses its op, param, const, ints, shape, has, expect, casts and width / channel records."""

    def _check_width(self, x: str, module: str, shape: tuple[int, ...]) -> None:
        """A Linear weight [out, in] must take the width of the tensor it meets; a weight stored
        transposed (or of another model) with the right byte count is named here."""
        have = self.widths.get(x)
        if len(shape) != 2 or (have is not None and have != shape[1]):
            raise BadInput(f"{self.ckpt.path}: {self.prefix}{module}.weight has shape {list(shape)}: a Linear weight "
                           f"[out, in] taking {have if have is not None else 'a'}-wide inputs here; the checkpoint "
                           "is damaged, transposed or of another architecture")

    def linear(self, x: str, module: str, bias: bool | None = True) -> str:
        """torch Linear: y = x @ W^T + b, W kept in checkpoint layout [out, in].
        bias: True = required (a missing one is reported), False = none, None = if present."""
        if self.has(f"{module}.weight"):
            shape = tuple(self.shape(f"{module}.weight"))
            self._check_width(x, module, shape)
            if bias is not False and self.has(f"{module}.bias") and tuple(self.shape(f"{module}.bias")) != shape[:1]:
                raise BadInput(f"{self.ckpt.path}: {self.prefix}{module}.weight has shape {list(shape)} but "
                               f"{module}.bias has shape {list(self.shape(module + '.bias'))} (one value per output "
                               "row); one of them is damaged or transposed")
        w = self.op("Transpose", self.param(f"{module}.weight"), perm=[1, 0])
        y = self.op("MatMul", x, w)
        if bias is None:
            bias = self.has(f"{module}.bias")
        y = self.op("Add", y, self.param(f"{module}.bias")) if bias else y
        if self.has(f"{module}.weight"):
            self.widths[y] = self.shape(f"{module}.weight")[0]
        return y

    def linear_chunks(self, x: str, module: str, chunks: int) -> list[str]:
        """torch Linear followed by chunk(chunks, dim=-1), written as one linear per chunk over
        slices of the weight and bias (constant-folded by the backends): no Split of the
        activation, and each chunk's consumer (e.g. GEGLU's Gelu) fuses into its GEMM."""
        out = self.shape(f"{module}.weight")[0]
        if out % chunks:
            raise BadInput(f"{self.ckpt.path}: {self.prefix}{module}.weight has {out} rows, not divisible into {chunks}")
        return self.linear_rows(x, module, [out // chunks] * chunks)

    def linear_rows(self, x: str, module: str, rows: list[int], bias: bool = True) -> list[str]:
        """torch Linear followed by a split of its output into blocks of `rows` (summing to the
        weight's rows): one GEMM per block over a slice of the weight (and bias)."""
        shape = tuple(self.shape(f"{module}.weight"))
        self._check_width(x, module, shape)
        if sum(rows) != shape[0]:
            raise BadInput(f"{self.ckpt.path}: {self.prefix}{module}.weight has {shape[0]} rows; the {self.name} "
                           f"splits it into {' + '.join(map(str, rows))}; the checkpoint is damaged or of another "
                           "architecture")
        if bias:
            self.expect(f"{module}.bias", (shape[0],), "one bias per output row")
        w = self.param(f"{module}.weight")
        b = self.param(f"{module}.bias") if bias else None
        ys, start = [], 0
        for n in rows:
            s, e, axis = self.ints(start), self.ints(start + n), self.ints(0)
            wi = self.op("Transpose", self.op("Slice", w, s, e, axis), perm=[1, 0])
            y = self.op("MatMul", x, wi)
            y = self.op("Add", y, self.op("Slice", b, s, e, axis)) if bias else y
            self.widths[y] = n
            ys.append(y)
            start += n
        return ys

    def matmul_cols(self, x: str, module: str, start: int, end: int) -> str:
        """x @ W[:, start:end]^T: the part of a Linear that reads input columns start..end (a
        Linear over a concatenation, computed without concatenating the activations)."""
        w = self.op("Slice", self.param(f"{module}.weight"), self.ints(start), self.ints(end), self.ints(1))
        y = self.op("MatMul", x, self.op("Transpose", w, perm=[1, 0]))
        self.widths[y] = self.shape(f"{module}.weight")[0]
        return y

    def conv2d(self, x: str, module: str, stride: int = 1, pad: int | tuple[int, ...] | None = None,
               bias: bool = True) -> str:
        """`pad`: one size for every side, or ONNX's (top, left, bottom, right); default kernel // 2.
        `bias` False: a conv without one (torch's bias=False)."""
        out_ch, in_ch, kh, kw = self.shape(f"{module}.weight")
        self._check_channels(x, module, in_ch, "takes")
        pads = list(pad) if isinstance(pad, tuple) else [kh // 2 if pad is None else pad] * 4
        ins = [x, self.param(f"{module}.weight")] + ([self.param(f"{module}.bias")] if bias else [])
        y = self.op("Conv", *ins, strides=[stride, stride], pads=pads, kernel_shape=[kh, kw])
        self.channels[y] = out_ch
        return y

    def group_norm(self, x: str, module: str, groups: int, eps: float) -> str:
        if self.has(f"{module}.weight"):
            channels = self.shape(f"{module}.weight")[0]
            self._check_channels(x, module, channels, "normalizes")
            if groups < 1 or channels % groups:
                section = "vae" if self.name.startswith("vae") else self.name
                raise BadInput(f"{self.ckpt.path}: {self.prefix}{module} normalizes {channels} channels, which do not "
                               f"split into {groups} groups; pass the model's group count with "
                               f"--set {section}.groups=N (a divisor of {channels}; a diffusers config's norm_num_groups)")
        y = self.op("GroupNormalization", self.to_fp32(x), self.param(f"{module}.weight", fp32=True),
                    self.param(f"{module}.bias", fp32=True), num_groups=groups, epsilon=eps)
        return self.from_fp32(y)

    def layer_norm(self, x: str, module: str, eps: float) -> str:
        y = self.op("LayerNormalization", self.to_fp32(x), self.param(f"{module}.weight", fp32=True),
                    self.param(f"{module}.bias", fp32=True), axis=-1, epsilon=eps)
        return self.from_fp32(y)

    def rms_norm(self, x: str, module: str | None, eps: float, weight: str = "weight", fp32_out: bool = False) -> str:
        """x / sqrt(mean(x^2) + eps) [* scale], over the last axis, computed in fp32 (T5, QK norms,
        Chroma's approximator). `module` None: no learned scale; `fp32_out`: leave the result in fp32."""
        if module is not None and x in self.widths:
            self.expect(f"{module}.{weight}", (self.widths[x],), "one scale per channel")
        x32 = self.to_fp32(x)
        ms = self.op("ReduceMean", self.op("Pow", x32, self.const(np.array(2.0, np.float32))), self.ints(-1),
                     keepdims=1)
        y = self.op("Div", x32, self.op("Sqrt", self.op("Add", ms, self.const(np.array(eps, np.float32)))))
        if module is not None:
            y = self.op("Mul", y, self.param(f"{module}.{weight}", fp32=True))
        return y if fp32_out else self.from_fp32(y)

    def plain_layer_norm(self, x: str, width: int, eps: float) -> str:
        """LayerNorm without learned scale or bias (elementwise_affine=False), in fp32."""
        ones = self.const(np.ones(width, np.float32), hint="ones")
        y = self.op("LayerNormalization", self.to_fp32(x), ones, axis=-1, epsilon=eps)
        self.widths[y] = width
        return self.from_fp32(y)

    def silu(self, x: str) -> str:
        return self.op("Mul", x, self.op("Sigmoid", x))

    def gelu(self, x: str) -> str:
        return self.op("Gelu", x)

    def gelu_tanh(self, x: str) -> str:
        """GELU with the tanh approximation (torch's approximate="tanh", T5's gelu_new)."""
        return self.op("Gelu", x, approximate="tanh")

    def quick_gelu(self, x: str) -> str:
        return self.op("Mul", x, self.op("Sigmoid", self.op("Mul", x, self.const(np.array(1.702), self.dtype))))

    def upsample2x(self, x: str, like: str | None = None) -> str:
        """Nearest-neighbour x2, as torch's F.interpolate(scale_factor=2, mode="nearest"); with
        `like`, to that tensor's height and width instead (F.interpolate(size=...), what diffusers
        does when a level's input had an odd size): the same result wherever that is twice x's."""
        nearest = {"mode": "nearest", "coordinate_transformation_mode": "asymmetric", "nearest_mode": "floor"}
        if like is None:
            return self.op("Resize", x, "", self.const(np.array([1, 1, 2, 2], np.float32), hint="scales"), **nearest)
        sizes = self.op("Concat", self.op("Slice", self.op("Shape", x), self.ints(0), self.ints(2)),
                        self.op("Slice", self.op("Shape", like), self.ints(2), self.ints(4)), axis=0)
        return self.op("Resize", x, "", "", sizes, **nearest)

    def softmax(self, x: str) -> str:
        return self.from_fp32(self.op("Softmax", self.to_fp32(x), axis=-1))

    def attention(self, q: str, k: str, v: str, heads: int, dim: int, mask: str | None = None) -> str:
        """Multi-head attention on [B, N, dim] inputs, written as MatMul/Softmax (every backend
        fuses this pattern; ONNX Attention-23 crashes the TensorRT-RTX builder)."""
        if heads < 1 or dim % heads:
            raise BadInput(f"{self.name}: {heads} attention heads do not divide the width {dim}; "
                           f"pass a divisor with --set {self.name}.num_heads=N")
        d = dim // heads
        qh, kh, vh = (self.split_heads(t, heads, d) for t in (q, k, v))
        return self.merge_heads(self.sdpa(qh, kh, vh, d ** -0.5, mask), dim)

    def split_heads(self, x: str, heads: int, d: int) -> str:
        """[B, N, heads * d] -> [B, heads, N, d]."""
        return self.op("Transpose", self.op("Reshape", x, self.ints(0, 0, heads, d)), perm=[0, 2, 1, 3])

    def merge_heads(self, x: str, dim: int) -> str:
        """[B, heads, N, d] -> [B, N, heads * d]."""
        y = self.op("Reshape", self.op("Transpose", x, perm=[0, 2, 1, 3]), self.ints(0, 0, dim))
        self.widths[y] = dim
        return y

    def sdpa(self, q: str, k: str, v: str, scale: float | None, mask: str | None = None) -> str:
        """softmax(q k^T * scale + mask) v on [B, heads, N, d] tensors; scores and softmax in fp32.
        `scale` None: no scaling (T5)."""
        scores = self.to_fp32(self.op("MatMul", q, self.op("Transpose", k, perm=[0, 1, 3, 2])))
        if scale is not None:
            scores = self.op("Mul", scores, self.const(np.array(scale, np.float32)))
        if mask is not None:
            scores = self.op("Add", scores, mask)
        probs = self.from_fp32(self.op("Softmax", scores, axis=-1))
        return self.op("MatMul", probs, v)
