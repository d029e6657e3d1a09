//! Progress bars on stderr (indicatif draws nothing when stderr is not a
//! terminal: logs, pipes, MPI ranks).

use indicatif::{ProgressBar, ProgressStyle};
use std::sync::Mutex;

/// A bar counting `unit`s, labelled `msg`.
pub fn counting(msg: String, unit: &str) -> ProgressBar {
    let style =
        ProgressStyle::with_template(&format!("{{msg}} [{{bar:40}}] {{pos}}/{{len}} {unit}"))
            .unwrap_or_else(|_| ProgressStyle::default_bar());
    let bar = ProgressBar::new(0).with_style(style);
    bar.set_message(msg);
    bar
}

/// The load's bar, between its first and last layer.
static LOADING: Mutex<Option<ProgressBar>> = Mutex::new(None);

/// [`kvant_model::LoadOptions::progress`]: a bar over the layers while a
/// model loads (quantizing a large checkpoint at load takes a while),
/// cleared when the last one is in.
pub fn layer_loaded(done: usize, total: usize) {
    let Ok(mut slot) = LOADING.lock() else { return };
    let bar = slot.get_or_insert_with(|| counting("loading".into(), "layers"));
    bar.set_length(total as u64);
    bar.set_position(done as u64);
    if done >= total {
        bar.finish_and_clear();
        *slot = None;
    }
}
