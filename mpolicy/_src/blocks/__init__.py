"""Block-scaled formats (MXFP8, MXFP4, NVFP4): quantizers and their parts.

`formats` names the formats, `layout` cuts arrays into blocks, `mx` and
`nvfp4` hold each format's scale and element arithmetic (exact float32
steps from `float32_ops`, rounding from `rounding`), and `quantize` is the
public door: `quantize_blocks`, `dequantize_blocks`, `fake_quantize`.
"""
