//! kvant-kernels: CPU kernels. Each op has a scalar reference (`*_ref`) beside its fast paths.

pub mod cpu;
pub mod dot;
pub mod error;
pub mod matmul;
pub mod quant;
pub mod activation;
pub mod attention;
pub mod norm;
pub mod rope;
pub mod softmax;

pub use error::KernelError;
