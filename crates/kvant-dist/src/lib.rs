//! kvant-dist: the communicator interface (with an in-process backend,
//! ranks as threads, and an MPI backend behind the `mpi` feature), a
//! wrapper that meters collectives and models a network, the α-β cost
//! model, and the sharding plans of tensor, expert and data parallelism.
//!
//! Nothing here knows about models: the model layer asks [`layout`] which
//! heads, columns, vocabulary rows and experts a rank holds, and calls the
//! collectives of [`comm`] in its forward pass.

pub mod comm;
pub mod cost;
pub mod error;
pub mod launch;
pub mod layout;
pub mod local;
pub mod metered;
#[cfg(feature = "mpi")]
pub mod mpi;

pub use comm::{Buffer, Collective, Comm, CommExt, Elem, Kind, ReduceOp, Request};
pub use cost::NetModel;
pub use error::DistError;
pub use launch::launched_by_mpirun;
pub use layout::{Layout, LayoutError};
pub use metered::{KindStats, Metered, Stats};
#[cfg(feature = "mpi")]
pub use mpi::MpiRuntime;
