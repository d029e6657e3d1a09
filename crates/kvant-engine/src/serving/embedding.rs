//! Embedding requests: a prompt run through the model without sampling,
//! its hidden states after the final norm pooled into one vector (what
//! llama.cpp's server and vLLM's pooling runner return from
//! `/v1/embeddings`).
//!
//! A prompt may run in several chunks (chunked prefill, preemption); the
//! pooled vector must not depend on how it was cut, or on the batch it
//! ran in, so rows are added in token order, one at a time, into an f64
//! sum: the same additions in the same order whatever the chunks.

/// How a prompt's hidden states become one vector.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pooling {
    /// The average over every token (sentence-transformers' default).
    Mean,
    /// The last token's: it has attended over the whole prompt (decoder
    /// embedding models such as e5-mistral, gte-Qwen or Qwen3-Embedding).
    Last,
    /// The first token's (BERT's `[CLS]`).
    First,
}

impl Pooling {
    /// Whether a chunk of positions `pos0..end` of a `len`-token prompt
    /// has rows this pooling reads.
    pub(super) fn reads(self, pos0: usize, end: usize, len: usize) -> bool {
        match self {
            Pooling::Mean => end > pos0,
            Pooling::Last => end == len && end > pos0,
            Pooling::First => pos0 == 0 && end > 0,
        }
    }
}

/// A running pooling over a prompt's rows.
#[derive(Clone, Debug)]
pub(super) struct Pooled {
    pooling: Pooling,
    sum: Vec<f64>,
    rows: usize,
}

impl Pooled {
    pub fn new(pooling: Pooling) -> Self {
        Pooled {
            pooling,
            sum: Vec::new(),
            rows: 0,
        }
    }

    pub fn pooling(&self) -> Pooling {
        self.pooling
    }

    /// Forgets every row (the prompt starts over after a preemption).
    pub fn reset(&mut self) {
        self.sum.clear();
        self.rows = 0;
    }

    /// Takes the hidden rows (`width` values each) of the chunk at
    /// positions `pos0..end` of a `len`-token prompt; `rows` holds exactly
    /// the rows [`Pooling::reads`] asked for: none, or all of the chunk's.
    pub fn push(&mut self, rows: &[f32], width: usize, pos0: usize, end: usize, len: usize) {
        if width == 0 || rows.is_empty() {
            return;
        }
        if self.sum.len() != width {
            self.sum = vec![0.0; width];
        }
        let chunk = rows.chunks_exact(width);
        match self.pooling {
            Pooling::Mean => {
                for row in chunk {
                    for (s, &v) in self.sum.iter_mut().zip(row) {
                        *s += f64::from(v);
                    }
                    self.rows += 1;
                }
            }
            Pooling::Last if end == len => {
                if let Some(row) = chunk.last() {
                    set(&mut self.sum, row);
                    self.rows = 1;
                }
            }
            Pooling::First if pos0 == 0 => {
                if let Some(row) = chunk.into_iter().next() {
                    set(&mut self.sum, row);
                    self.rows = 1;
                }
            }
            Pooling::Last | Pooling::First => {}
        }
    }

    /// The pooled vector (not normalized); empty if no row came.
    pub fn finish(&self) -> Vec<f32> {
        let n = self.rows.max(1) as f64;
        self.sum.iter().map(|&s| (s / n) as f32).collect()
    }
}

fn set(sum: &mut [f64], row: &[f32]) {
    for (s, &v) in sum.iter_mut().zip(row) {
        *s = f64::from(v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rows `0..n` of width 3, row `i` = `[i, 2i, -i]` scaled oddly.
    fn rows(range: std::ops::Range<usize>) -> Vec<f32> {
        range
            .flat_map(|i| {
                let x = i as f32 * 0.37 + 0.1;
                [x, 2.0 * x, -x]
            })
            .collect()
    }

    fn pool(p: Pooling, cuts: &[usize], len: usize) -> Vec<f32> {
        let mut pooled = Pooled::new(p);
        let mut at = 0;
        for &end in cuts.iter().chain([&len]) {
            if p.reads(at, end, len) {
                pooled.push(&rows(at..end), 3, at, end, len);
            }
            at = end;
        }
        pooled.finish()
    }

    #[test]
    fn pooling_does_not_depend_on_chunks() {
        let len = 11;
        for p in [Pooling::Mean, Pooling::Last, Pooling::First] {
            let whole = pool(p, &[], len);
            for cuts in [
                &[1][..],
                &[5],
                &[3, 4, 10],
                &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10],
            ] {
                assert_eq!(pool(p, cuts, len), whole, "{p:?} cut at {cuts:?}");
            }
        }
        let all = rows(0..len);
        let mean: Vec<f32> = (0..3)
            .map(|c| (0..len).map(|r| f64::from(all[r * 3 + c])).sum::<f64>() / len as f64)
            .map(|v| v as f32)
            .collect();
        assert_eq!(pool(Pooling::Mean, &[4], len), mean);
        assert_eq!(pool(Pooling::Last, &[4], len), all[30..33].to_vec());
        assert_eq!(pool(Pooling::First, &[4], len), all[0..3].to_vec());
    }

    #[test]
    fn reset_starts_over() {
        let mut p = Pooled::new(Pooling::Mean);
        p.push(&rows(0..4), 3, 0, 4, 4);
        p.reset();
        p.push(&rows(0..4), 3, 0, 4, 4);
        assert_eq!(p.finish(), pool(Pooling::Mean, &[], 4));
    }
}
