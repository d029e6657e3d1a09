//! A decode step allocates nothing but what it returns: once the scratch
//! buffers have grown to the batch, a forward pass's activations, lists of
//! sequences, matrix-product inputs and attention, recurrent-state and
//! expert-routing scratch are all reused (DESIGN.md: no allocation in the
//! hot path). Counted with a global allocator over every thread of the
//! process (the kernels' pool included) for the model families: dense
//! attention, sliding windows, a mixture of experts, latent attention with
//! experts, and gated delta-rule layers.
//!
//! This binary holds one test, so nothing else allocates while it counts.

mod common;

use common::{fixtures, open};
use kvant_model::arch::decoder::{LoadOptions, Logits, SeqStep};
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

/// The system allocator, counting allocations (and reallocations).
struct Counting;

static ALLOCATIONS: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call is forwarded to the system allocator unchanged.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, size: usize) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: as above.
        unsafe { System.realloc(p, l, size) }
    }
}

#[global_allocator]
static COUNTING: Counting = Counting;

/// What a pass returns: its logits and its hidden rows.
const RETURNED: usize = 2;

/// Passes at most: the prompt and 20 decode steps (the longer prompt's 9
/// tokens and 20 more fit the 32 a sequence's 8 blocks of 4 hold).
const STEPS: usize = 21;

#[test]
fn a_warm_decode_step_allocates_only_its_results() {
    for name in [
        "llama-gqa",
        "gemma3-text",
        "mixtral-moe",
        "deepseek-v3",
        "qwen3-next",
    ] {
        let m = open(&fixtures().join(name), LoadOptions::default());
        let block = 4;
        let mut pool = m.new_pool(block, 16, 2).expect("pool");
        let tables: [Vec<u32>; 2] = [(0..8).collect(), (8..16).collect()];
        let prompts: [Vec<u32>; 2] = [(1..8).collect(), (3..12).collect()];
        let mut len = [0usize; 2];
        let mut next = [0u32; 2];
        let mut counts = Vec::new();
        // The prompts, then decode steps until three in a row allocate only
        // their results. Not "the first three after a warm-up": a pool
        // thread's scratch (thread-local, reused ever after) is made the
        // first time that thread takes a task, which on a loaded machine
        // can be any step (CI once saw a worker join late: [58, 2, 2, 7,
        // 2, 2]); an allocation every step never gives three clean ones.
        for step in 0..STEPS {
            if step >= 4 && counts[step - 3..].iter().all(|&c| c == RETURNED) {
                break;
            }
            let tokens: [&[u32]; 2] = match step {
                0 => [&prompts[0], &prompts[1]],
                _ => [&next[..1], &next[1..]],
            };
            let steps: Vec<SeqStep<'_>> = (0..2)
                .map(|i| SeqStep {
                    tokens: tokens[i],
                    pos0: len[i],
                    table: &tables[i],
                    logits: Logits::Last,
                    state: i,
                })
                .collect();
            let before = ALLOCATIONS.load(Ordering::Relaxed);
            let logits = m.forward_batch(&mut pool, &steps).expect("forward");
            counts.push(ALLOCATIONS.load(Ordering::Relaxed) - before);
            for i in 0..2 {
                len[i] += tokens[i].len();
            }
            // Greedy next tokens, so the steps run real positions.
            let vocab = m.config().vocab;
            for (i, row) in logits.chunks_exact(vocab).enumerate() {
                let best = (0..vocab).max_by(|&a, &b| row[a].total_cmp(&row[b]));
                next[i] = best.unwrap_or(0) as u32;
            }
        }
        let clean = counts.len() >= 4 && counts[counts.len() - 3..].iter().all(|&c| c == RETURNED);
        assert!(
            clean,
            "{name}: allocations per pass {counts:?} (the prompt, then decode steps; \
             never three in a row with only the {RETURNED} returned buffers)"
        );
    }
}
