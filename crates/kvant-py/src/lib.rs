//! The `kvant` Python package's native module (`kvant._kvant`): the training
//! kernels over torch tensors (`train`) and inference (`llm`). The Python
//! side (`python/kvant/`) turns the kernels into torch custom ops.

mod llm;
mod omp;
mod tensor;
mod train;

use kvant_kernels::pool;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;

/// Starts kvant's thread pool with `threads` threads (torch's own count,
/// so the two do not oversubscribe the cores). Returns the pool's size;
/// a pool already running with another size keeps it and raises.
#[pyfunction]
fn set_threads(threads: usize) -> PyResult<usize> {
    pool::set_global_threads(threads).map_err(|e| PyRuntimeError::new_err(e.to_string()))?;
    Ok(pool::global().threads())
}

/// Starts kvant's thread pool on torch's OpenMP threads (`threads` of
/// them, torch's count), so kvant's ops run on the team torch keeps awake
/// between its own. Returns False, starting nothing, when no OpenMP
/// runtime is loaded; raises when the pool already runs.
#[pyfunction]
fn use_torch_threads(threads: usize) -> PyResult<bool> {
    omp::use_torch_team(threads).map_err(|e| PyRuntimeError::new_err(e.to_string()))
}

/// The size of kvant's thread pool (starting it if it is not running).
#[pyfunction]
fn threads() -> usize {
    pool::global().threads()
}

/// The SIMD tier the kernels run ("scalar", "avx2", "avx512").
#[pyfunction]
fn simd_tier() -> &'static str {
    kvant_kernels::cpu::tier().name()
}

#[pymodule]
fn _kvant(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(set_threads, m)?)?;
    m.add_function(wrap_pyfunction!(threads, m)?)?;
    m.add_function(wrap_pyfunction!(use_torch_threads, m)?)?;
    m.add_function(wrap_pyfunction!(simd_tier, m)?)?;
    m.add_class::<llm::Llm>()?;
    m.add_class::<llm::TextStream>()?;
    train::register(m)?;
    Ok(())
}
