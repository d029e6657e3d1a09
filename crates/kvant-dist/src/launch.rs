//! Whether this process was started by an MPI launcher, read from the
//! environment the launcher sets. Built without the `mpi` feature too, so
//! that a binary without MPI refuses clearly to run as one of several
//! ranks (each rank would otherwise run the whole model alone).

/// This process's `(rank, size)` when an MPI launcher (`mpirun`,
/// `mpiexec`, `srun` with PMI or PMIx) started it, from the variables
/// Open MPI (`OMPI_COMM_WORLD_RANK`, `OMPI_COMM_WORLD_SIZE`), PMI
/// (`PMI_RANK`, `PMI_SIZE`, as MPICH's Hydra sets) or PMIx (`PMIX_RANK`,
/// with the size from Open MPI, PMI or Slurm's `SLURM_NTASKS`) set;
/// `None` when none is set or they do not make sense (a rank not below
/// the size).
pub fn launched_by_mpirun() -> Option<(usize, usize)> {
    from_env(|name| std::env::var(name).ok())
}

/// [`launched_by_mpirun`] over any source of variables.
fn from_env(var: impl Fn(&str) -> Option<String>) -> Option<(usize, usize)> {
    let num = |name: &str| var(name).and_then(|v| v.trim().parse::<usize>().ok());
    let pairs = [
        ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
        ("PMI_RANK", "PMI_SIZE"),
        ("PMIX_RANK", "OMPI_COMM_WORLD_SIZE"),
        ("PMIX_RANK", "PMI_SIZE"),
        ("PMIX_RANK", "SLURM_NTASKS"),
    ];
    pairs
        .iter()
        .find_map(|&(rank, size)| match (num(rank), num(size)) {
            (Some(r), Some(s)) if r < s => Some((r, s)),
            _ => None,
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(vars: &[(&str, &str)]) -> Option<(usize, usize)> {
        let map: HashMap<String, String> =
            vars.iter().map(|&(k, v)| (k.into(), v.into())).collect();
        from_env(|k| map.get(k).cloned())
    }

    #[test]
    fn launchers() {
        assert_eq!(env(&[]), None);
        assert_eq!(
            env(&[("OMPI_COMM_WORLD_RANK", "1"), ("OMPI_COMM_WORLD_SIZE", "2")]),
            Some((1, 2))
        );
        assert_eq!(env(&[("PMI_RANK", "0"), ("PMI_SIZE", "4")]), Some((0, 4)));
        assert_eq!(
            env(&[("PMIX_RANK", "3"), ("SLURM_NTASKS", "4")]),
            Some((3, 4))
        );
        assert_eq!(
            env(&[("PMIX_RANK", "2"), ("OMPI_COMM_WORLD_SIZE", "3")]),
            Some((2, 3))
        );
        // A rank alone, or a rank not below the size, is not a launch.
        assert_eq!(env(&[("PMIX_RANK", "0")]), None);
        assert_eq!(env(&[("SLURM_NTASKS", "4")]), None);
        assert_eq!(env(&[("PMI_RANK", "4"), ("PMI_SIZE", "4")]), None);
        assert_eq!(env(&[("PMI_RANK", "x"), ("PMI_SIZE", "4")]), None);
    }
}
