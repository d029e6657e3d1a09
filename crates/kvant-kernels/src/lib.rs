//! kvant-kernels: CPU kernels. Each op has a scalar reference (`*_ref`) beside its fast paths.

pub mod cpu;
pub mod quant;
