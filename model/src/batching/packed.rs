//! vLLM's packed layout for tensors a trainer broadcasts
//! (`vllm/distributed/weight_transfer/packed_tensor.py`, `packed: true` in an update's
//! info): the tensors, in the order the update lists them, are laid back to back as raw
//! bytes in `uint8` buffers, with no alignment and no padding between them. A buffer
//! takes tensors until its size passes `packed_buffer_size_bytes`: the tensor that takes
//! it past the size is the last in it (so a buffer may exceed the size by up to one
//! tensor, and a tensor larger than the size fills a buffer alone). Trainer and receiver
//! cut the list the same way from the names, shapes and dtypes alone, so the plan here
//! needs nothing from the wire but the buffers themselves.

use std::ops::Range;

use super::control::TensorMeta;

/// vLLM's default `packed_buffer_size_bytes` (1 GiB).
pub const DEFAULT_BUFFER_BYTES: usize = 1 << 30;

/// One broadcast buffer: which tensors (indices into the update's list) it holds, and its
/// size.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackedBuffer {
    pub tensors: Range<usize>,
    pub bytes: usize,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PackError {
    #[error("packed_buffer_size_bytes must be at least 1, got 0")]
    ZeroBuffer,
    #[error("tensor {name:?}: shape {shape:?} of {dtype} elements overflows a byte count")]
    Overflow {
        name: String,
        shape: Vec<usize>,
        dtype: &'static str,
    },
    #[error("tensor {name:?} (bytes {start}..{end} of its packed buffer, shape {shape:?} of {dtype}) ends past the buffer's {len} bytes: the trainer packed different shapes or dtypes than the update lists")]
    Short {
        name: String,
        shape: Vec<usize>,
        dtype: &'static str,
        start: usize,
        end: usize,
        len: usize,
    },
    #[error("the packed buffer holds {len} bytes, {extra} past the end of its last tensor {name:?}: the trainer packed different shapes or dtypes than the update lists")]
    Long {
        name: String,
        len: usize,
        extra: usize,
    },
    #[error("a packed buffer holds no tensor")]
    Empty,
}

fn size(t: &TensorMeta) -> Result<usize, PackError> {
    t.bytes().ok_or_else(|| PackError::Overflow {
        name: t.name.clone(),
        shape: t.shape.clone(),
        dtype: t.dtype.name(),
    })
}

/// The buffers a trainer broadcasts for `tensors` with `packed_buffer_size_bytes` =
/// `buffer_bytes`, in order (`packed_nccl_broadcast_producer` / `_consumer`).
pub fn plan(tensors: &[TensorMeta], buffer_bytes: usize) -> Result<Vec<PackedBuffer>, PackError> {
    if buffer_bytes == 0 {
        return Err(PackError::ZeroBuffer);
    }
    let mut out = Vec::new();
    let mut start = 0;
    let mut total = 0usize;
    for (i, t) in tensors.iter().enumerate() {
        total = total
            .checked_add(size(t)?)
            .ok_or_else(|| PackError::Overflow {
                name: t.name.clone(),
                shape: t.shape.clone(),
                dtype: t.dtype.name(),
            })?;
        // Strictly past: a buffer that reaches the size exactly takes the next tensor too.
        if total > buffer_bytes {
            out.push(PackedBuffer {
                tensors: start..i + 1,
                bytes: total,
            });
            start = i + 1;
            total = 0;
        }
    }
    if start < tensors.len() {
        out.push(PackedBuffer {
            tensors: start..tensors.len(),
            bytes: total,
        });
    }
    Ok(out)
}

/// Where each of `tensors` lies in a received buffer of `len` bytes that packs exactly
/// them (`unpack_tensor`); a size that disagrees names the tensor where it shows.
pub fn unpack(len: usize, tensors: &[TensorMeta]) -> Result<Vec<Range<usize>>, PackError> {
    let last = tensors.last().ok_or(PackError::Empty)?;
    let mut at = 0usize;
    let mut out = Vec::with_capacity(tensors.len());
    for t in tensors {
        let n = size(t)?;
        let end = at
            .checked_add(n)
            .filter(|&e| e <= len)
            .ok_or_else(|| PackError::Short {
                name: t.name.clone(),
                shape: t.shape.clone(),
                dtype: t.dtype.name(),
                start: at,
                end: at.saturating_add(n),
                len,
            })?;
        out.push(at..end);
        at = end;
    }
    if at < len {
        return Err(PackError::Long {
            name: last.name.clone(),
            len,
            extra: len - at,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::safetensors::DType;

    fn t(name: &str, dtype: DType, shape: &[usize]) -> TensorMeta {
        TensorMeta {
            name: name.into(),
            dtype,
            shape: shape.to_vec(),
        }
    }

    #[test]
    fn tensors_lie_back_to_back_with_no_padding() {
        // 3 bf16 (6 bytes), then an f32 at offset 6 (not 4- or 8-aligned), a scalar, an
        // empty tensor and an f16 row.
        let ts = [
            t("a", DType::BF16, &[3]),
            t("b", DType::F32, &[2, 1]),
            t("s", DType::F32, &[]),
            t("e", DType::BF16, &[0, 4]),
            t("h", DType::F16, &[5]),
        ];
        assert_eq!(
            unpack(28, &ts).unwrap(),
            vec![0..6, 6..14, 14..18, 18..18, 18..28]
        );
        // One buffer holds them all under the default size.
        assert_eq!(
            plan(&ts, DEFAULT_BUFFER_BYTES).unwrap(),
            vec![PackedBuffer {
                tensors: 0..5,
                bytes: 28
            }]
        );
    }

    #[test]
    fn a_buffer_closes_after_the_tensor_that_takes_it_past_the_size() {
        // 8, 8, 8, 4 bytes with a 16-byte buffer: 8+8 = 16 is not past 16, so the third
        // tensor joins (24 > 16) and closes it; the last goes alone.
        let ts = [
            t("a", DType::F32, &[2]),
            t("b", DType::BF16, &[4]),
            t("c", DType::F16, &[2, 2]),
            t("d", DType::F32, &[1]),
        ];
        assert_eq!(
            plan(&ts, 16).unwrap(),
            vec![
                PackedBuffer {
                    tensors: 0..3,
                    bytes: 24
                },
                PackedBuffer {
                    tensors: 3..4,
                    bytes: 4
                },
            ]
        );
        // A tensor larger than the size fills a buffer alone; one that ends a buffer
        // exactly leaves none empty behind it.
        let big = [t("big", DType::F32, &[10]), t("x", DType::BF16, &[1])];
        assert_eq!(
            plan(&big, 8).unwrap(),
            vec![
                PackedBuffer {
                    tensors: 0..1,
                    bytes: 40
                },
                PackedBuffer {
                    tensors: 1..2,
                    bytes: 2
                },
            ]
        );
        assert_eq!(
            plan(&big[..1], 8).unwrap(),
            vec![PackedBuffer {
                tensors: 0..1,
                bytes: 40
            }]
        );
        assert_eq!(plan(&[], 8).unwrap(), vec![]);
        assert_eq!(plan(&ts, 0).unwrap_err(), PackError::ZeroBuffer);
    }

    #[test]
    fn every_buffer_of_a_plan_unpacks_to_its_tensors() {
        let ts: Vec<TensorMeta> = (0..40)
            .map(|i| {
                let dtype = [DType::BF16, DType::F16, DType::F32][i % 3];
                t(&format!("w{i}"), dtype, &[i % 7, 3])
            })
            .collect();
        let bufs = plan(&ts, 50).unwrap();
        let mut next = 0;
        for b in &bufs {
            assert_eq!(b.tensors.start, next);
            next = b.tensors.end;
            let sizes: usize = ts[b.tensors.clone()]
                .iter()
                .map(|t| t.bytes().unwrap())
                .sum();
            assert_eq!(sizes, b.bytes);
            let ranges = unpack(b.bytes, &ts[b.tensors.clone()]).unwrap();
            assert_eq!(ranges.last().unwrap().end, b.bytes);
        }
        assert_eq!(next, ts.len());
        // Only the last buffer may end at or under the size.
        assert!(bufs[..bufs.len() - 1].iter().all(|b| b.bytes > 50));
    }

    #[test]
    fn sizes_that_disagree_name_the_tensor() {
        let ts = [t("a", DType::BF16, &[3]), t("b.weight", DType::F32, &[2])];
        let short = unpack(10, &ts).unwrap_err();
        assert!(
            matches!(&short, PackError::Short { name, start: 6, end: 14, len: 10, .. } if name == "b.weight"),
            "{short:?}"
        );
        assert!(short.to_string().contains("\"b.weight\""), "{short}");
        let long = unpack(15, &ts).unwrap_err();
        assert_eq!(
            long,
            PackError::Long {
                name: "b.weight".into(),
                len: 15,
                extra: 1
            }
        );
        assert_eq!(unpack(0, &[]).unwrap_err(), PackError::Empty);
        let huge = [t("h", DType::F32, &[usize::MAX / 2, 3])];
        assert!(
            matches!(plan(&huge, 8).unwrap_err(), PackError::Overflow { name, .. } if name == "h")
        );
    }
}
