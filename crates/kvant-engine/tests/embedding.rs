//! Embedding requests in the serving engine: the pooled hidden states of
//! a prompt equal the model's own forward pass, do not depend on the batch,
//! the chunking or preemption, never come from the prefix cache, and leave
//! the generation batched with them unchanged.

mod common;
use common::{
    collect, crowded, embed, embedding, greedy, load_fixture as load, prompts,
    start_fixture as start, submit,
};
use kvant_engine::serving::{EngineConfig, Pooling, Shutdown, SubmitError};
use kvant_model::arch::decoder::Logits;

const DENSE: &str = "gguf/llama-gqa.Q4_0.gguf";

/// The pooling computed from the model's own forward pass over the
/// whole prompt in one sequence.
fn reference(m: &kvant_model::LoadedModel, ids: &[u32], pooling: Pooling) -> Vec<f32> {
    let mut cache = m.model.new_cache(ids.len()).expect("cache");
    let (_, hidden) = m
        .model
        .forward_hidden(ids, &mut cache, Logits::Hidden)
        .expect("forward");
    let h = m.model.config().hidden;
    let rows: Vec<&[f32]> = hidden.chunks_exact(h).collect();
    assert_eq!(rows.len(), ids.len());
    match pooling {
        Pooling::Mean => (0..h)
            .map(|c| (rows.iter().map(|r| f64::from(r[c])).sum::<f64>() / rows.len() as f64) as f32)
            .collect(),
        Pooling::Last => rows[rows.len() - 1].to_vec(),
        Pooling::First => rows[0].to_vec(),
    }
}

/// Every pooling of 16 prompts, alone, is bit for bit the pooling of the
/// model's own forward pass over the whole prompt (the engine's passes
/// are batch-invariant, and the mean adds rows in token order); among 16
/// concurrent generations and embeddings on a crowded engine (chunked,
/// preempted) it is the same bits as alone, and the generations give the
/// tokens they give alone. Over a dense model, a mixture of experts with
/// latent attention and an MTP module, and a hybrid with recurrent state.
#[test]
fn embeddings_match_the_model_and_ignore_the_batch() {
    for (name, mtp) in [(DENSE, false), ("deepseek-v3", true), ("qwen3-next", false)] {
        embeddings_of(name, mtp);
    }
}

fn embeddings_of(name: &str, mtp: bool) {
    let m = load(name, mtp);
    let ps = prompts(16, 7);
    let pooling = |i: usize| [Pooling::Mean, Pooling::Last, Pooling::First][i % 3];
    let (h, t) = start(name, mtp, EngineConfig::default());
    let alone: Vec<Vec<f32>> = ps
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let (v, usage) = embedding(&embed(&h, p.clone(), pooling(i)));
            assert_eq!(usage.prompt_tokens, p.len());
            assert_eq!((usage.completion_tokens, usage.cached_tokens), (0, 0));
            v
        })
        .collect();
    let tokens_alone: Vec<Vec<u32>> = ps
        .iter()
        .map(|p| collect(&submit(&h, greedy(p.clone(), 12))).0)
        .collect();
    h.shutdown(Shutdown::Drain);
    t.join().unwrap();
    for (i, p) in ps.iter().enumerate() {
        let want = reference(&m, p, pooling(i));
        assert_eq!(alone[i], want, "{name}: prompt {i} ({:?})", pooling(i));
    }

    let (h, t) = start(name, mtp, crowded());
    let (gens, embeds): (Vec<_>, Vec<_>) = ps
        .iter()
        .enumerate()
        .map(|(i, p)| {
            (
                submit(&h, greedy(p.clone(), 12)),
                embed(&h, p.clone(), pooling(i)),
            )
        })
        .unzip();
    for i in 0..ps.len() {
        assert_eq!(embedding(&embeds[i]).0, alone[i], "{name}: prompt {i}");
        assert_eq!(collect(&gens[i]).0, tokens_alone[i], "{name}: prompt {i}");
    }
    let metrics = h.metrics();
    assert!(metrics.preemptions > 0, "{name}: {metrics:?}");
    assert_eq!(metrics.kv_blocks_used, 0);
    h.shutdown(Shutdown::Drain);
    t.join().unwrap();
}

/// A prompt already in the prefix cache (the generation before it) is
/// recomputed for its embedding, which is the same as on a fresh engine.
#[test]
fn embeddings_never_start_from_the_prefix_cache() {
    let p: Vec<u32> = (0..37).map(|i| 5 + (i * 13) % 200).collect();
    let (h, t) = start(DENSE, false, EngineConfig::default());
    let fresh = embedding(&embed(&h, p.clone(), Pooling::Mean)).0;
    collect(&submit(&h, greedy(p.clone(), 8)));
    let (again, usage) = embedding(&embed(&h, p.clone(), Pooling::Mean));
    assert_eq!(again, fresh);
    assert_eq!(usage.cached_tokens, 0);
    // A generation after the embedding reuses its blocks.
    let (_, _, u) = collect(&submit(&h, greedy(p.clone(), 4)));
    assert!(u.cached_tokens > 0, "{u:?}");
    h.shutdown(Shutdown::Drain);
    t.join().unwrap();
}

/// Bad embedding requests are refused at submission; an embedding may
/// fill the whole context (nothing is generated after it).
#[test]
fn bad_embedding_requests_are_refused() {
    let (h, t) = start(DENSE, false, EngineConfig::default());
    let sink = || -> kvant_engine::serving::EventSink { Box::new(|_| true) };
    let ctx = h.context_length();
    assert_eq!(
        h.embed(Vec::new(), Pooling::Mean, sink()).err(),
        Some(SubmitError::EmptyPrompt)
    );
    assert!(matches!(
        h.embed(vec![1, 1_000_000], Pooling::Mean, sink()).err(),
        Some(SubmitError::TokenOutOfRange { id: 1_000_000, .. })
    ));
    assert!(matches!(
        h.embed(vec![5; ctx + 1], Pooling::Last, sink()).err(),
        Some(SubmitError::PromptTooLong { .. })
    ));
    let (v, usage) = embedding(&embed(&h, vec![5; ctx], Pooling::Last));
    assert_eq!(usage.prompt_tokens, ctx);
    assert!(v.iter().all(|x| x.is_finite()));
    h.shutdown(Shutdown::Drain);
    t.join().unwrap();
}
