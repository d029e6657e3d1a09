//! Block-quantized formats: scalar dequantizers and row dot products.
