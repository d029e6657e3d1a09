//! Token counts of one response.

use serde::Serialize;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
    pub prompt_tokens_details: PromptTokensDetails,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct PromptTokensDetails {
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: usize,
}

impl Usage {
    /// Adds one choice's engine usage: the prompt is shared by every choice
    /// and counted once, the completions add up.
    pub fn add_choice(&mut self, u: &kvant_engine::serving::Usage) {
        self.prompt_tokens = u.prompt_tokens;
        self.completion_tokens += u.completion_tokens;
        self.total_tokens = self.prompt_tokens + self.completion_tokens;
        let cached = &mut self.prompt_tokens_details.cached_tokens;
        *cached = (*cached).max(u.cached_tokens);
    }
}
