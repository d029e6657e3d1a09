//! Stop strings over streamed text.
//!
//! Text is released only once it cannot be the start of a stop string, so a
//! stop sequence split across tokens is never half-printed.

pub struct StopMatcher {
    stops: Vec<String>,
    /// Text received but not yet released.
    pending: String,
}

impl StopMatcher {
    pub fn new(stops: Vec<String>) -> Self {
        StopMatcher {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            pending: String::new(),
        }
    }

    /// Adds text; returns what may be released and whether a stop matched
    /// (in which case the text up to the stop is released and the rest dropped).
    pub fn push(&mut self, text: &str) -> (String, bool) {
        self.pending.push_str(text);
        let hit = self
            .stops
            .iter()
            .filter_map(|s| self.pending.find(s.as_str()))
            .min();
        if let Some(at) = hit {
            let out = self.pending[..at].to_string();
            self.pending.clear();
            return (out, true);
        }
        // Hold back the longest suffix that is a proper prefix of some stop.
        let hold = self
            .stops
            .iter()
            .map(|s| longest_suffix_prefix(&self.pending, s))
            .max()
            .unwrap_or(0);
        let cut = self.pending.len() - hold;
        let out = self.pending[..cut].to_string();
        self.pending.drain(..cut);
        (out, false)
    }

    /// Ends a stream with its last text (the detokenizer's flushed tail):
    /// returns everything left to release and whether that tail completed
    /// a stop string (then the text stops there, as in [`Self::push`]).
    pub fn finish_with(&mut self, tail: &str) -> (String, bool) {
        let (mut out, hit) = self.push(tail);
        if !hit {
            out.push_str(&std::mem::take(&mut self.pending));
        }
        (out, hit)
    }
}

/// Length of the longest suffix of `text` that is a proper prefix of
/// `stop`, on char boundaries: what a stream must hold back while it may
/// still grow into `stop`.
pub fn longest_suffix_prefix(text: &str, stop: &str) -> usize {
    let max = text.len().min(stop.len().saturating_sub(1));
    (1..=max)
        .rev()
        .find(|&n| {
            let start = text.len() - n;
            text.is_char_boundary(start) && stop.starts_with(&text[start..])
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_split_across_pieces() {
        let mut m = StopMatcher::new(vec!["</end>".into()]);
        assert_eq!(m.push("hello </"), ("hello ".into(), false));
        assert_eq!(m.push("en"), ("".into(), false));
        assert_eq!(m.push("d> tail"), ("".into(), true));
    }

    #[test]
    fn false_alarm_is_released_and_earliest_stop_wins() {
        let mut m = StopMatcher::new(vec!["ab".into(), "xyz".into()]);
        assert_eq!(m.push("a"), ("".into(), false));
        assert_eq!(m.push("c"), ("ac".into(), false));
        assert_eq!(m.push("1xyz2ab"), ("1".into(), true));
        let mut m = StopMatcher::new(vec!["é!".into()]);
        assert_eq!(m.push("café"), ("caf".into(), false));
        assert_eq!(m.finish_with(""), ("é".into(), false));
    }

    /// The end of a stream releases what was held back, unless its last
    /// text completes a stop string.
    #[test]
    fn the_tail_can_complete_a_stop() {
        let mut m = StopMatcher::new(vec!["</end>".into()]);
        assert_eq!(m.push("x </e"), ("x ".into(), false));
        assert_eq!(m.finish_with("nd> more"), ("".into(), true));
        let mut m = StopMatcher::new(vec!["</end>".into()]);
        assert_eq!(m.push("x </e"), ("x ".into(), false));
        assert_eq!(m.finish_with("n"), ("</en".into(), false));
    }
}
