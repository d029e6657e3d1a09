//! A batch's routing as the experts take it: each token's `top_k` expert
//! ids and weights, with the one check the fused layer and its reference
//! share.

use crate::error::{check_len, checked_mul, KernelError};

/// The routing of `n_tokens` tokens (what [`super::route`] wrote): `ids`
/// and `weights` are `[n_tokens, top_k]`. `n_tokens` is explicit since
/// with `top_k == 0` the slices do not tell it.
#[derive(Clone, Copy, Debug)]
pub struct Routing<'a> {
    pub ids: &'a [u32],
    pub weights: &'a [f32],
    pub n_tokens: usize,
    pub top_k: usize,
}

impl Routing<'_> {
    /// Checks that `ids` and `weights` hold `top_k` values per token;
    /// returns the number of assignments, `n_tokens * top_k`.
    ///
    /// # Errors
    /// [`KernelError::LengthMismatch`] for a slice of another length,
    /// [`KernelError::SizeOverflow`] if the product overflows.
    pub fn check(&self) -> Result<usize, KernelError> {
        let n_assign = checked_mul("moe", self.n_tokens, self.top_k)?;
        check_len("moe ids [n_tokens, top_k]", n_assign, self.ids.len())?;
        check_len(
            "moe weights [n_tokens, top_k]",
            n_assign,
            self.weights.len(),
        )?;
        Ok(n_assign)
    }

    /// Checks that `len` values are `n_tokens` rows of `h` (the tokens, or
    /// the output).
    ///
    /// # Errors
    /// As [`Routing::check`].
    pub fn check_rows(&self, what: &'static str, h: usize, len: usize) -> Result<(), KernelError> {
        check_len(what, checked_mul("moe", self.n_tokens, h)?, len)
    }
}
