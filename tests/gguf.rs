//! GGUF import checked against llama.cpp's own Python package (`gguf`): arbor's
//! dequantizer against `gguf.quants.dequantize` on random blocks of every supported type,
//! tiny random models converted to GGUF as llama.cpp's converter does (q/k rows permuted,
//! Llama-3 RoPE factors as a tensor, Mixtral's experts stacked) giving the same bits as
//! their HF directory, and a SentencePiece vocabulary (trained by the `sentencepiece`
//! library, written as llama.cpp writes it) encoding as the library does. Without python3 and those modules the tests
//! are skipped locally and fail in CI.

mod cli_support;

use std::ffi::OsStr;
use std::path::Path;

use arbor_model::gguf::dequant::{dequantize, GgmlType};
use cli_support::*;
use half::f16;

const PY_MODULES: &[&str] = &["gguf", "numpy"];
const PY_INSTALL: &str = "python3 -m pip install gguf==0.19.0 numpy";

/// xorshift64*: deterministic bytes without a dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// A finite f16 of moderate size (either sign), as scales are.
    fn f16_bytes(&mut self) -> [u8; 2] {
        let m = (self.next() % 2000) as f32 / 1000.0 - 1.0;
        f16::from_f32(m * 0.05).to_bits().to_le_bytes()
    }
}

/// `blocks` random blocks of `ty` whose f16 fields (scales, mins, or the values of F16 /
/// BF16 / F32 tensors) are finite.
fn random_blocks(ty: GgmlType, blocks: usize, rng: &mut Rng) -> Vec<u8> {
    let (be, bb) = ty.block().expect("a known type");
    let mut b: Vec<u8> = (0..blocks * bb).map(|_| rng.next() as u8).collect();
    let halves: &[usize] = match ty {
        GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => &[0],
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4K | GgmlType::Q5K => &[0, 2],
        GgmlType::Q2K => &[80, 82],
        GgmlType::Q3K => &[108],
        GgmlType::Q6K => &[208],
        _ => &[],
    };
    for blk in b.chunks_exact_mut(bb) {
        for &o in halves {
            blk[o..o + 2].copy_from_slice(&rng.f16_bytes());
        }
    }
    match ty {
        GgmlType::F16 => b
            .chunks_exact_mut(2)
            .for_each(|c| c.copy_from_slice(&rng.f16_bytes())),
        GgmlType::BF16 => b.chunks_exact_mut(2).for_each(|c| {
            let v = half::bf16::from_f32(f16::from_le_bytes(rng.f16_bytes()).to_f32());
            c.copy_from_slice(&v.to_bits().to_le_bytes())
        }),
        GgmlType::F32 => b.chunks_exact_mut(4).for_each(|c| {
            let v = f16::from_le_bytes(rng.f16_bytes()).to_f32() * 3.7;
            c.copy_from_slice(&v.to_le_bytes())
        }),
        _ => {}
    }
    assert_eq!(b.len() / bb * be, blocks * be);
    b
}

#[test]
fn dequantization_matches_the_gguf_package() {
    if !python_has(PY_MODULES, PY_INSTALL) {
        return;
    }
    let s = Scratch::new("gguf-dequant");
    let script = gguf_ref_script("dequant_ref.py");
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    for id in [0, 1, 30, 2, 3, 6, 7, 8, 10, 11, 12, 13, 14] {
        let ty = GgmlType::from_id(id);
        let name = ty.name();
        let bytes = random_blocks(ty, 64, &mut rng);
        let (inp, out) = (
            s.path().join(format!("{name}.bin")),
            s.path().join(format!("{name}.f32")),
        );
        std::fs::write(&inp, &bytes).expect("write blocks");
        run_python(
            &script,
            &[OsStr::new(&name), inp.as_os_str(), out.as_os_str()],
        );
        let want: Vec<f32> = std::fs::read(&out)
            .expect("read reference")
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        let mut got = Vec::new();
        dequantize(ty, &bytes, &mut got).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(got.len(), want.len(), "{name}: value count");
        // Both compute in f32 in the same order: the same bits.
        for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
            assert!(g.is_finite(), "{name}[{i}] = {g}");
            assert_eq!(g.to_bits(), w.to_bits(), "{name}[{i}]: arbor {g}, gguf {w}");
        }
        eprintln!("{name}: {} values, bit-identical", got.len());
    }
}

/// `arbor generate` with `--jsonl` on `model`: two text prompts, six greedy tokens, top-2.
fn generate_jsonl(model: &Path, tp: usize) -> String {
    let m = model.to_string_lossy();
    let args = [
        "generate",
        "--model",
        &m,
        "--prompt",
        "Hello there, GGUF",
        "--prompt",
        "x",
        "--max-tokens",
        "6",
        "--logprobs",
        "2",
        "--jsonl",
    ];
    let o = if tp == 1 {
        run_arbor(&args)
    } else {
        run_launched(tp, &args)
    };
    let (out, err) = text(&o);
    assert!(o.status.success(), "{}:\n{out}\n{err}", model.display());
    // arbor-launch prefixes rank 0's lines.
    let out: Vec<&str> = out
        .lines()
        .map(|l| l.strip_prefix("[rank 0] ").unwrap_or(l))
        .collect();
    assert_eq!(out.len(), 2, "{out:?}");
    out.join("\n")
}

fn convert(hf: &Path, out: &Path, ty: &str) {
    run_python(
        &gguf_ref_script("hf_to_gguf.py"),
        &[hf.as_os_str(), out.as_os_str(), OsStr::new(ty)],
    );
}

#[test]
fn converted_tiny_models_give_the_hf_directorys_bits() {
    if !python_has(PY_MODULES, PY_INSTALL) {
        return;
    }
    let s = Scratch::new("gguf-convert");
    for (arch, ty) in [
        ("llama", "F32"),
        ("qwen2", "BF16"),
        ("qwen3", "BF16"),
        ("mixtral", "BF16"),
    ] {
        let hf = s.path().join(arch);
        make_tiny(arch, &hf);
        let g = s.path().join(format!("{arch}.gguf"));
        convert(&hf, &g, ty);
        // Weights, RoPE (Llama-3 factors recovered from rope_freqs.weight), q/k row order,
        // Mixtral's stacked experts, tokenizer, EOS: every bit of every record is the same.
        assert_eq!(generate_jsonl(&g, 1), generate_jsonl(&hf, 1), "{arch} {ty}");
        // Row-parallel shards are column reads of the file.
        assert_eq!(
            generate_jsonl(&g, 2),
            generate_jsonl(&hf, 1),
            "{arch} {ty} at TP 2"
        );
    }
}

#[test]
fn a_q8_0_conversion_scores_close_to_the_original() {
    if !python_has(PY_MODULES, PY_INSTALL) {
        return;
    }
    let s = Scratch::new("gguf-q8");
    let hf = s.path().join("llama");
    make_tiny("llama", &hf);
    let g = s.path().join("llama-q8_0.gguf");
    convert(&hf, &g, "Q8_0");
    let input = s.path().join("score.jsonl");
    let tokens: Vec<u32> = "The quick brown fox jumps over the lazy dog"
        .bytes()
        .map(u32::from)
        .collect();
    std::fs::write(
        &input,
        serde_json::json!({"id": 0, "tokens": tokens, "prompt_len": 1}).to_string() + "\n",
    )
    .expect("write score input");
    let score = |m: &Path| -> Vec<f64> {
        let out = s.path().join(format!(
            "{}.jsonl",
            m.file_name().unwrap().to_string_lossy()
        ));
        let o = run_arbor(&[
            "score",
            "--model",
            &m.to_string_lossy(),
            "--input",
            &input.to_string_lossy(),
            "--out",
            &out.to_string_lossy(),
        ]);
        let (so, se) = text(&o);
        assert!(o.status.success(), "{so}\n{se}");
        read_jsonl(&out)[0]["logprobs"]
            .as_array()
            .expect("logprobs")
            .iter()
            .map(|v| v.as_f64().expect("number"))
            .collect()
    };
    let (q, f) = (score(&g), score(&hf));
    assert_eq!(q.len(), tokens.len() - 1);
    let max = q
        .iter()
        .zip(&f)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max);
    eprintln!(
        "Q8_0 vs bf16: max |Δ log-prob| {max:.4} over {} positions",
        q.len()
    );
    // 8-bit blocks perturb each weight by ~0.4 % of its block's largest: a small change to
    // log-probs around -2.5, but not none.
    assert!(max > 0.0 && max < 0.1, "max |Δ log-prob| {max}");
}

/// Texts for the SentencePiece comparison: words of its training text, whitespace runs,
/// digits (split one by one), characters it never saw (byte fallback), newlines.
const SPM_TEXTS: &[&str] = &[
    "the quick brown fox",
    "Hello world",
    "  indented   with  spaces\tand tabs",
    "numbers like 2024 and 3.14159",
    "naïve café über ünïcödé",
    "emoji 😀 and 日本語 fall back to bytes",
    "I'm sure they'll say it can't",
    "fn main() { x[0] = 1; }",
    "trailing space ",
    "new\nlines\n\n",
    " leading space",
    "Paris is the capital of France.",
];

#[test]
fn a_sentencepiece_vocabulary_encodes_as_sentencepiece_does() {
    if !python_has(
        &["gguf", "numpy", "sentencepiece"],
        "python3 -m pip install gguf==0.19.0 numpy sentencepiece",
    ) {
        return;
    }
    let s = Scratch::new("gguf-spm");
    let (g, texts, out) = (
        s.path().join("spm.gguf"),
        s.path().join("texts.json"),
        s.path().join("ids.jsonl"),
    );
    std::fs::write(&texts, serde_json::to_string(SPM_TEXTS).expect("JSON")).expect("write texts");
    run_python(
        &gguf_ref_script("spm_vocab.py"),
        &[
            s.path().join("work").as_os_str(),
            g.as_os_str(),
            texts.as_os_str(),
            out.as_os_str(),
        ],
    );
    let mut m = arbor_model::gguf::GgufModel::open(&g).unwrap_or_else(|e| panic!("{e}"));
    let (tok, cfg) = m.tokenizer_parts();
    let tok = tok.expect("a tokenizer");
    let enc = arbor_model::PromptEncoder {
        tokenizer: &tok,
        config: cfg.as_ref(),
    };
    let records = read_jsonl(&out);
    assert_eq!(records.len(), SPM_TEXTS.len());
    for r in records {
        let text = r["text"].as_str().expect("text");
        let want: Vec<u32> = r["ids"]
            .as_array()
            .expect("ids")
            .iter()
            .map(|v| v.as_u64().expect("id") as u32)
            .collect();
        let got = enc
            .encode(text, true)
            .unwrap_or_else(|e| panic!("{text:?}: {e}"));
        assert_eq!(got, want, "{text:?}");
        let decoded = tok
            .decode(&got, true)
            .unwrap_or_else(|e| panic!("{text:?}: {e}"));
        assert_eq!(decoded, r["decoded"].as_str().expect("decoded"), "{text:?}");
    }
}
