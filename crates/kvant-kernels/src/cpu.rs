//! CPU feature detection and the SIMD tier chosen once at start-up.
