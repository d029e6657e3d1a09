//! Memory read bandwidth on 1 and 2 threads: the denominator of the decode
//! roofline (decoding streams every weight once per token), next to which
//! the `matmul` bench's one-token GiB/s figures are read.
//!
//! `cargo bench -p kvant-kernels --bench bandwidth`

use kvant_kernels::bandwidth::measure_read_bandwidth;

/// 256 MiB: eight times a 32 MiB last-level cache, so passes hit DRAM.
const BUFFER_BYTES: usize = 256 << 20;
/// Passes per thread count; the best one is reported.
const REPEATS: usize = 5;

fn main() {
    for threads in [1, 2] {
        let bw = measure_read_bandwidth(BUFFER_BYTES, threads, REPEATS);
        println!(
            "read bandwidth, {threads} thread(s), {} MiB buffer, best of {REPEATS}: {:.2} GB/s",
            BUFFER_BYTES >> 20,
            bw / 1e9
        );
    }
}
