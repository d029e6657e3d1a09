//! RoPE
