//! GLU
