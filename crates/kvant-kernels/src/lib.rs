//! kvant-kernels: CPU kernels. Each op has a scalar reference (`*_ref`) beside its fast paths.

pub mod activation;
pub mod attention;
pub mod cpu;
pub mod dot;
pub mod error;
pub mod matmul;
pub mod norm;
pub mod quant;
pub mod rope;
pub mod softmax;

pub use error::KernelError;
