//! kvant-kernels: CPU kernels. Each op has a scalar reference (`*_ref`) beside its fast paths.

pub mod activation;
pub mod attention;
pub mod bandwidth;
pub mod cpu;
pub mod delta;
pub mod dot;
pub mod error;
pub mod group;
pub mod halfpack;
pub mod int8;
pub mod lanes;
pub mod linear;
pub mod matmul;
pub mod moe;
pub mod norm;
mod per_tier;
pub mod pool;
pub mod quant;
pub mod rope;
pub mod softmax;
pub mod vecops;

pub use error::KernelError;
