//! `kvant info`.

use super::input::load_model;
use crate::args::ModelArg;
use anyhow::Result;

pub fn run(model: &ModelArg, json: bool) -> Result<()> {
    let m = load_model(model)?;
    let i = &m.info;
    if json {
        println!("{}", serde_json::to_string_pretty(i)?);
        return Ok(());
    }
    let dtypes: Vec<String> = i
        .tensor_dtypes
        .iter()
        .map(|(d, n)| format!("{d}×{n}"))
        .collect();
    println!("format          {}", i.format);
    println!("architecture    {}", i.architecture);
    println!(
        "parameters      {} ({:.1} M)",
        i.parameters,
        i.parameters as f64 / 1e6
    );
    println!("tensor dtypes   {}", dtypes.join(", "));
    println!(
        "weights         {:.1} MB ({:.1} MB read per token)",
        i.total_weight_bytes as f64 / 1e6,
        i.weight_bytes as f64 / 1e6
    );
    if let Some((n, k, layers)) = i.experts {
        println!("experts         {n} routed, {k} per token, in {layers} layers");
    }
    match i.mla_latent_dim {
        Some(d) => println!(
            "KV cache        {} B/token: latent attention, {d} values per layer ({} B/token expanded, {:.1}× more)",
            i.kv_bytes_per_token,
            i.kv_bytes_per_token_expanded,
            i.kv_bytes_per_token_expanded as f64 / i.kv_bytes_per_token.max(1) as f64
        ),
        None => println!("KV cache        {} B/token", i.kv_bytes_per_token),
    }
    if let Some((heads, dim, topk)) = i.indexer {
        println!(
            "sparse          each token attends to its top {topk} positions \
             (indexer: {heads} heads of {dim}, one {dim}-value key per position cached)"
        );
    }
    if let Some((layers, bytes, kind)) = i.linear {
        println!(
            "linear attn     {layers} of {} layers {kind}: {bytes} B of state per sequence, \
             whatever its length (the KV cache above is the other layers')",
            i.layers
        );
    }
    if let Some(c) = &i.compressed {
        let count = |k: &str| c.layers.iter().filter(|&&l| l == k).count();
        println!(
            "compressed attn {} CSA, {} HCA, {} sliding-only layers: {} KB of window rings and \
             compressor tails per sequence, whatever its length",
            count("csa"),
            count("hca"),
            count("sliding"),
            c.state_bytes / 1024
        );
        for (n, bytes) in &c.at {
            println!(
                "  at {:>6} tokens {:>8.1} MB per sequence ({} B/token)",
                n,
                *bytes as f64 / 1e6,
                bytes / n
            );
        }
    }
    if i.mtp_layers > 0 {
        let how = match m.model.has_mtp() {
            true => "loaded",
            false => "load with --mtp",
        };
        println!("MTP layers      {} ({how})", i.mtp_layers);
    }
    match i.context_length == i.trained_context_length {
        true => println!("context length  {}", i.context_length),
        false => println!(
            "context length  {} (--ctx-size; the checkpoint declares {})",
            i.context_length, i.trained_context_length
        ),
    }
    println!(
        "layers          {} (hidden {}, heads {}, kv heads {})",
        i.layers, i.hidden_size, i.heads, i.kv_heads
    );
    println!("tokenizer       {} ({} tokens)", i.tokenizer, i.vocab_size);
    println!(
        "chat template   {}",
        if i.chat_template { "yes" } else { "no" }
    );
    Ok(())
}
