//! GGML tensor types and their dequantization to f32, block by block, as llama.cpp's
//! `ggml-quants.c` defines it (the `dequantize_row_*` functions), in f32 arithmetic.
//! Checked against the `gguf` Python package's numpy dequantizer by `tests/gguf.rs`.

use half::{bf16, f16};

/// A GGML tensor type, by its id in the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32,
    F16,
    BF16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
    /// A type GGML defines that arbor does not dequantize: (id, name, elements per block,
    /// bytes per block).
    Other(u32, &'static str, usize, usize),
    /// An id this version of arbor does not know at all.
    Unknown(u32),
}

/// Every type arbor dequantizes, for messages.
pub const SUPPORTED: &str =
    "F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K";

const QK_K: usize = 256;

impl GgmlType {
    pub fn from_id(id: u32) -> Self {
        use GgmlType::*;
        match id {
            0 => F32,
            1 => F16,
            30 => BF16,
            2 => Q4_0,
            3 => Q4_1,
            6 => Q5_0,
            7 => Q5_1,
            8 => Q8_0,
            10 => Q2K,
            11 => Q3K,
            12 => Q4K,
            13 => Q5K,
            14 => Q6K,
            9 => Other(9, "Q8_1", 32, 40),
            15 => Other(15, "Q8_K", 256, 292),
            16 => Other(16, "IQ2_XXS", 256, 66),
            17 => Other(17, "IQ2_XS", 256, 74),
            18 => Other(18, "IQ3_XXS", 256, 98),
            19 => Other(19, "IQ1_S", 256, 50),
            20 => Other(20, "IQ4_NL", 32, 18),
            21 => Other(21, "IQ3_S", 256, 110),
            22 => Other(22, "IQ2_S", 256, 82),
            23 => Other(23, "IQ4_XS", 256, 136),
            24 => Other(24, "I8", 1, 1),
            25 => Other(25, "I16", 1, 2),
            26 => Other(26, "I32", 1, 4),
            27 => Other(27, "I64", 1, 8),
            28 => Other(28, "F64", 1, 8),
            29 => Other(29, "IQ1_M", 256, 56),
            34 => Other(34, "TQ1_0", 256, 54),
            35 => Other(35, "TQ2_0", 256, 66),
            39 => Other(39, "MXFP4", 32, 17),
            id => Unknown(id),
        }
    }

    pub fn name(self) -> String {
        use GgmlType::*;
        match self {
            F32 => "F32".into(),
            F16 => "F16".into(),
            BF16 => "BF16".into(),
            Q4_0 => "Q4_0".into(),
            Q4_1 => "Q4_1".into(),
            Q5_0 => "Q5_0".into(),
            Q5_1 => "Q5_1".into(),
            Q8_0 => "Q8_0".into(),
            Q2K => "Q2_K".into(),
            Q3K => "Q3_K".into(),
            Q4K => "Q4_K".into(),
            Q5K => "Q5_K".into(),
            Q6K => "Q6_K".into(),
            Other(_, name, _, _) => name.into(),
            Unknown(id) => format!("unknown type id {id}"),
        }
    }

    /// (elements per block, bytes per block); None for an unknown id.
    pub fn block(self) -> Option<(usize, usize)> {
        use GgmlType::*;
        Some(match self {
            F32 => (1, 4),
            F16 | BF16 => (1, 2),
            Q4_0 => (32, 18),
            Q4_1 => (32, 20),
            Q5_0 => (32, 22),
            Q5_1 => (32, 24),
            Q8_0 => (32, 34),
            Q2K => (QK_K, 84),
            Q3K => (QK_K, 110),
            Q4K => (QK_K, 144),
            Q5K => (QK_K, 176),
            Q6K => (QK_K, 210),
            Other(_, _, n, b) => (n, b),
            Unknown(_) => return None,
        })
    }

    /// Whether arbor can dequantize this type.
    pub fn supported(self) -> bool {
        !matches!(self, GgmlType::Other(..) | GgmlType::Unknown(_))
    }

    /// Bytes of a tensor of `n` elements whose rows hold `row` elements.
    pub fn byte_size(self, row: usize, n: usize) -> Result<usize, String> {
        let (be, bb) = self
            .block()
            .ok_or_else(|| "arbor does not know this GGML type's block size".to_string())?;
        if !row.is_multiple_of(be) {
            return Err(format!(
                "rows of {row} elements are not a whole number of {be}-element blocks"
            ));
        }
        (n / be)
            .checked_mul(bb)
            .ok_or_else(|| "byte size overflows".into())
    }

    /// Bytes of one row of `row` elements (`row` already checked by `byte_size`).
    pub fn row_bytes(self, row: usize) -> usize {
        let (be, bb) = self.block().unwrap_or((1, 0));
        row / be * bb
    }
}

fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[i], b[i + 1]])).to_f32()
}

/// Dequantizes `bytes` (whole blocks of `ty`) onto the end of `out`. Errors name the
/// type when arbor does not implement it.
pub fn dequantize(ty: GgmlType, bytes: &[u8], out: &mut Vec<f32>) -> Result<(), String> {
    use GgmlType::*;
    let (be, bb) = ty
        .block()
        .ok_or_else(|| format!("{} cannot be dequantized", ty.name()))?;
    if !bytes.len().is_multiple_of(bb) {
        return Err(format!(
            "{} bytes are not whole {}-byte blocks of {}",
            bytes.len(),
            bb,
            ty.name()
        ));
    }
    out.reserve(bytes.len() / bb * be);
    let blocks = bytes.chunks_exact(bb);
    match ty {
        F32 => out.extend(
            bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
        ),
        F16 => out.extend(bytes.chunks_exact(2).map(|c| f16_at(c, 0))),
        BF16 => out.extend(
            bytes
                .chunks_exact(2)
                .map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32()),
        ),
        Q4_0 => blocks.for_each(|b| q4_0(b, out)),
        Q4_1 => blocks.for_each(|b| q4_1(b, out)),
        Q5_0 => blocks.for_each(|b| q5_0(b, out)),
        Q5_1 => blocks.for_each(|b| q5_1(b, out)),
        Q8_0 => blocks.for_each(|b| q8_0(b, out)),
        Q2K => blocks.for_each(|b| q2_k(b, out)),
        Q3K => blocks.for_each(|b| q3_k(b, out)),
        Q4K => blocks.for_each(|b| q4_k(b, out)),
        Q5K => blocks.for_each(|b| q5_k(b, out)),
        Q6K => blocks.for_each(|b| q6_k(b, out)),
        Other(..) | Unknown(_) => {
            return Err(format!(
                "{} is not a type arbor dequantizes (supported: {SUPPORTED})",
                ty.name()
            ))
        }
    }
    Ok(())
}

/// Dequantizes `bytes` to bf16 onto the end of `out`, through the reusable `scratch`.
pub fn dequantize_bf16(
    ty: GgmlType,
    bytes: &[u8],
    scratch: &mut Vec<f32>,
    out: &mut Vec<bf16>,
) -> Result<(), String> {
    scratch.clear();
    dequantize(ty, bytes, scratch)?;
    out.extend(scratch.iter().map(|&x| bf16::from_f32(x)));
    Ok(())
}

/// f16 d, 16 bytes of nibbles: (q - 8) · d; low nibbles are values 0..16, high 16..32.
fn q4_0(b: &[u8], out: &mut Vec<f32>) {
    let d = f16_at(b, 0);
    let qs = &b[2..18];
    out.extend(qs.iter().map(|&q| ((q & 0xF) as i32 - 8) as f32 * d));
    out.extend(qs.iter().map(|&q| ((q >> 4) as i32 - 8) as f32 * d));
}

/// f16 d, f16 m, 16 bytes of nibbles: q · d + m.
fn q4_1(b: &[u8], out: &mut Vec<f32>) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    let qs = &b[4..20];
    out.extend(qs.iter().map(|&q| (q & 0xF) as f32 * d + m));
    out.extend(qs.iter().map(|&q| (q >> 4) as f32 * d + m));
}

/// f16 d, 32 high bits, 16 bytes of nibbles: (q - 16) · d.
fn q5_0(b: &[u8], out: &mut Vec<f32>) {
    let d = f16_at(b, 0);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    let qs = &b[6..22];
    out.extend(qs.iter().enumerate().map(|(j, &q)| {
        let h = ((qh >> j) << 4) & 0x10;
        (((q & 0xF) as u32 | h) as i32 - 16) as f32 * d
    }));
    out.extend(qs.iter().enumerate().map(|(j, &q)| {
        let h = (qh >> (j + 12)) & 0x10;
        (((q >> 4) as u32 | h) as i32 - 16) as f32 * d
    }));
}

/// f16 d, f16 m, 32 high bits, 16 bytes of nibbles: q · d + m.
fn q5_1(b: &[u8], out: &mut Vec<f32>) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    let qs = &b[8..24];
    out.extend(qs.iter().enumerate().map(|(j, &q)| {
        let h = ((qh >> j) << 4) & 0x10;
        ((q & 0xF) as u32 | h) as f32 * d + m
    }));
    out.extend(qs.iter().enumerate().map(|(j, &q)| {
        let h = (qh >> (j + 12)) & 0x10;
        ((q >> 4) as u32 | h) as f32 * d + m
    }));
}

/// f16 d, 32 signed bytes: q · d.
fn q8_0(b: &[u8], out: &mut Vec<f32>) {
    let d = f16_at(b, 0);
    out.extend(b[2..34].iter().map(|&q| q as i8 as f32 * d));
}

/// 16 scale bytes (low nibble scale, high nibble min), 64 bytes of 2-bit values, f16 d,
/// f16 dmin.
fn q2_k(b: &[u8], out: &mut Vec<f32>) {
    let scales = &b[0..16];
    let (d, min) = (f16_at(b, 80), f16_at(b, 82));
    let mut is = 0;
    for half in 0..2 {
        let q = &b[16 + 32 * half..16 + 32 * (half + 1)];
        for shift in [0, 2, 4, 6] {
            for part in 0..2 {
                let sc = scales[is];
                is += 1;
                let (dl, ml) = (d * (sc & 0xF) as f32, min * (sc >> 4) as f32);
                out.extend(
                    q[16 * part..16 * (part + 1)]
                        .iter()
                        .map(|&x| dl * ((x >> shift) & 3) as f32 - ml),
                );
            }
        }
    }
}

/// 32 bytes of high-bit masks, 64 bytes of 2-bit values, 12 bytes of packed 6-bit scales,
/// f16 d.
fn q3_k(b: &[u8], out: &mut Vec<f32>) {
    const KMASK1: u32 = 0x0303_0303;
    const KMASK2: u32 = 0x0f0f_0f0f;
    let hm = &b[0..32];
    let d_all = f16_at(b, 108);
    let word =
        |i: usize| u32::from_le_bytes([b[96 + 4 * i], b[97 + 4 * i], b[98 + 4 * i], b[99 + 4 * i]]);
    let (a0, a1, tmp) = (word(0), word(1), word(2));
    let aux = [
        (a0 & KMASK2) | ((tmp & KMASK1) << 4),
        (a1 & KMASK2) | (((tmp >> 2) & KMASK1) << 4),
        ((a0 >> 4) & KMASK2) | (((tmp >> 4) & KMASK1) << 4),
        ((a1 >> 4) & KMASK2) | (((tmp >> 6) & KMASK1) << 4),
    ];
    let scale = |i: usize| (aux[i / 4] >> (8 * (i % 4))) as u8 as i8 as i32 - 32;
    let mut is = 0;
    let mut m = 1u8;
    for half in 0..2 {
        let q = &b[32 + 32 * half..32 + 32 * (half + 1)];
        for shift in [0, 2, 4, 6] {
            for part in 0..2 {
                let dl = d_all * scale(is) as f32;
                is += 1;
                let r = 16 * part..16 * (part + 1);
                out.extend(q[r.clone()].iter().zip(&hm[r]).map(|(&x, &h)| {
                    let v = ((x >> shift) & 3) as i32 - if h & m != 0 { 0 } else { 4 };
                    dl * v as f32
                }));
            }
            m <<= 1;
        }
    }
}

/// The j-th 6-bit scale and min of a Q4_K / Q5_K block's 12 packed bytes.
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// f16 d, f16 dmin, 12 bytes of packed scales and mins, 128 bytes of nibbles.
fn q4_k(b: &[u8], out: &mut Vec<f32>) {
    let (d, min) = (f16_at(b, 0), f16_at(b, 2));
    let scales = &b[4..16];
    for (chunk, q) in b[16..144].chunks_exact(32).enumerate() {
        let (sc1, m1) = scale_min_k4(2 * chunk, scales);
        let (sc2, m2) = scale_min_k4(2 * chunk + 1, scales);
        let (d1, m1) = (d * sc1 as f32, min * m1 as f32);
        let (d2, m2) = (d * sc2 as f32, min * m2 as f32);
        out.extend(q.iter().map(|&x| d1 * (x & 0xF) as f32 - m1));
        out.extend(q.iter().map(|&x| d2 * (x >> 4) as f32 - m2));
    }
}

/// f16 d, f16 dmin, 12 bytes of packed scales and mins, 32 bytes of high bits, 128 bytes
/// of nibbles.
fn q5_k(b: &[u8], out: &mut Vec<f32>) {
    let (d, min) = (f16_at(b, 0), f16_at(b, 2));
    let scales = &b[4..16];
    let qh = &b[16..48];
    for (chunk, ql) in b[48..176].chunks_exact(32).enumerate() {
        let (sc1, m1) = scale_min_k4(2 * chunk, scales);
        let (sc2, m2) = scale_min_k4(2 * chunk + 1, scales);
        let (d1, m1) = (d * sc1 as f32, min * m1 as f32);
        let (d2, m2) = (d * sc2 as f32, min * m2 as f32);
        let (u1, u2) = (1u8 << (2 * chunk), 2u8 << (2 * chunk));
        out.extend(
            ql.iter()
                .zip(qh)
                .map(|(&x, &h)| d1 * ((x & 0xF) + if h & u1 != 0 { 16 } else { 0 }) as f32 - m1),
        );
        out.extend(
            ql.iter()
                .zip(qh)
                .map(|(&x, &h)| d2 * ((x >> 4) + if h & u2 != 0 { 16 } else { 0 }) as f32 - m2),
        );
    }
}

/// 128 bytes of low nibbles, 64 bytes of high 2-bit pairs, 16 signed scales, f16 d.
fn q6_k(b: &[u8], out: &mut Vec<f32>) {
    let d = f16_at(b, 208);
    let start = out.len();
    out.resize(start + QK_K, 0.0);
    let y = &mut out[start..];
    for half in 0..2 {
        let ql = &b[64 * half..64 * (half + 1)];
        let qh = &b[128 + 32 * half..128 + 32 * (half + 1)];
        let sc = &b[192 + 8 * half..192 + 8 * (half + 1)];
        let y = &mut y[128 * half..128 * (half + 1)];
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i32 - 32;
            let q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
            let s = |k: usize| d * sc[is + k] as i8 as f32;
            y[l] = s(0) * q1 as f32;
            y[l + 32] = s(2) * q2 as f32;
            y[l + 64] = s(4) * q3 as f32;
            y[l + 96] = s(6) * q4 as f32;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f16_bytes(x: f32) -> [u8; 2] {
        f16::from_f32(x).to_bits().to_le_bytes()
    }

    #[test]
    fn q4_1_block_is_d_times_nibble_plus_m_low_nibbles_first() {
        let mut b = Vec::new();
        b.extend(f16_bytes(0.5));
        b.extend(f16_bytes(-1.0));
        b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        let mut out = Vec::new();
        dequantize(GgmlType::Q4_1, &b, &mut out).unwrap();
        for j in 0..16 {
            assert_eq!(out[j], 0.5 * j as f32 - 1.0);
            assert_eq!(out[16 + j], 0.5 * (15 - j) as f32 - 1.0);
        }
    }

    #[test]
    fn q8_0_and_q4_0_blocks() {
        let mut b = Vec::new();
        b.extend(f16_bytes(0.25));
        b.extend((0..32).map(|j| (j as i8 - 16) as u8));
        let mut out = Vec::new();
        dequantize(GgmlType::Q8_0, &b, &mut out).unwrap();
        assert_eq!(
            out,
            (0..32).map(|j| 0.25 * (j - 16) as f32).collect::<Vec<_>>()
        );
        let mut b = Vec::new();
        b.extend(f16_bytes(2.0));
        b.extend([0x80u8; 16]);
        out.clear();
        dequantize(GgmlType::Q4_0, &b, &mut out).unwrap();
        assert_eq!(&out[..16], &[-16.0; 16]);
        assert_eq!(&out[16..], &[0.0; 16]);
    }

    #[test]
    fn every_supported_type_fills_whole_blocks_and_others_are_named() {
        for id in [0, 1, 30, 2, 3, 6, 7, 8, 10, 11, 12, 13, 14] {
            let ty = GgmlType::from_id(id);
            let (be, bb) = ty.block().unwrap();
            let bytes: Vec<u8> = (0..3 * bb).map(|i| (i * 37 % 251) as u8 & 0x3b).collect();
            let mut out = Vec::new();
            dequantize(ty, &bytes, &mut out).unwrap();
            assert_eq!(out.len(), 3 * be, "{}", ty.name());
            assert!(dequantize(ty, &bytes[..bb - 1], &mut out).is_err() || bb == 1);
        }
        let e = dequantize(GgmlType::from_id(16), &[0; 66], &mut Vec::new()).unwrap_err();
        assert!(e.contains("IQ2_XXS") && e.contains("Q4_K"), "{e}");
        assert_eq!(GgmlType::from_id(99).name(), "unknown type id 99");
        assert!(GgmlType::Q4K
            .byte_size(100, 100)
            .unwrap_err()
            .contains("256"));
    }
}
