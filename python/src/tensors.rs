//! Torch tensors read by pointer: their dtype, shape and memory, checked before a byte is
//! read, then laid out as one safetensors image, the body `/update_weights_from_tensor`
//! takes.

use arbor_model::safetensors::{build_header, DType};
use pyo3::conversion::FromPyObjectOwned;
use pyo3::prelude::*;

use crate::error::{NResult, NativeError};

/// A torch tensor's memory as arbor will read it.
pub struct TorchTensor {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
    ptr: usize,
    nbytes: usize,
}

impl TorchTensor {
    /// The address of its first byte (`data_ptr()`).
    pub fn ptr(&self) -> usize {
        self.ptr
    }

    /// Its size in bytes.
    pub fn nbytes(&self) -> usize {
        self.nbytes
    }
}

fn attr<'py>(t: &Bound<'py, PyAny>, name: &str, what: &str) -> NResult<Bound<'py, PyAny>> {
    t.getattr(name).map_err(|_| {
        NativeError::Type(format!(
            "{what}: not a torch.Tensor (no attribute {name:?})"
        ))
    })
}

fn call0<'py, T: FromPyObjectOwned<'py>>(
    t: &Bound<'py, PyAny>,
    name: &str,
    what: &str,
) -> NResult<T> {
    let fail = |e: PyErr| NativeError::Type(format!("{what}: {name}() failed: {e}"));
    let v = attr(t, name, what)?.call0().map_err(fail)?;
    v.extract::<T>().map_err(|e| fail(e.into()))
}

/// The device of tensor `t`: its type (`"cpu"`, `"cuda"`, …) and index.
pub fn device(t: &Bound<'_, PyAny>, what: &str) -> NResult<(String, Option<usize>)> {
    let d = attr(t, "device", what)?;
    let kind = attr(&d, "type", what)?
        .extract()
        .map_err(|e| NativeError::Type(format!("{what}: device.type: {e}")))?;
    let index = attr(&d, "index", what)?
        .extract()
        .map_err(|e| NativeError::Type(format!("{what}: device.index: {e}")))?;
    Ok((kind, index))
}

/// Reads what arbor needs of tensor `t` (named `name`): on the CPU, strided and
/// contiguous, bf16 / f16 / f32, with a byte size that matches its shape.
pub fn describe(name: &str, t: &Bound<'_, PyAny>) -> NResult<TorchTensor> {
    let what = format!("tensor {name:?}");
    let (kind, _) = device(t, &what)?;
    if kind != "cpu" {
        return Err(NativeError::Input(format!(
            "{what} is on the {kind} device: arbor copies weights from host memory (pass .cpu())"
        )));
    }
    memory(name, t, &what)
}

/// What [`describe`] reads of a tensor on any device: strided and contiguous, bf16 / f16 /
/// f32, a byte size that matches its shape, its address.
pub fn memory(name: &str, t: &Bound<'_, PyAny>, what: &str) -> NResult<TorchTensor> {
    strided(t, what)?;
    let dtype = match dtype_name(t, what)?.as_str() {
        "torch.bfloat16" => DType::BF16,
        "torch.float16" => DType::F16,
        "torch.float32" => DType::F32,
        other => {
            return Err(NativeError::Type(format!(
                "{what}: dtype {other} is not one arbor takes (torch.bfloat16, torch.float16, torch.float32)"
            )))
        }
    };
    let (shape, nbytes) = contiguous_shape(t, what, dtype.size())?;
    let numel: usize = call0(t, "numel", what)?;
    let elem: usize = call0(t, "element_size", what)?;
    if elem != dtype.size() || numel.checked_mul(elem) != Some(nbytes) {
        return Err(NativeError::Type(format!(
            "{what}: {numel} elements of {elem} bytes do not make shape {shape:?} of {}",
            dtype.name()
        )));
    }
    let ptr = data_ptr(t, what, nbytes)?;
    Ok(TorchTensor {
        name: name.to_string(),
        dtype,
        shape,
        ptr,
        nbytes,
    })
}

/// `t`'s layout is torch's strided one (not a sparse or nested tensor).
fn strided(t: &Bound<'_, PyAny>, what: &str) -> NResult<()> {
    let layout = attr(t, "layout", what)?.str().map(|s| s.to_string());
    if layout.as_deref().ok() != Some("torch.strided") {
        return Err(NativeError::Type(format!(
            "{what}: layout {} is not torch.strided (a sparse or nested tensor)",
            layout.unwrap_or_else(|_| "?".into())
        )));
    }
    Ok(())
}

/// `t`'s dtype as torch names it (`torch.float32`, ...).
fn dtype_name(t: &Bound<'_, PyAny>, what: &str) -> NResult<String> {
    attr(t, "dtype", what)?
        .str()
        .map(|s| s.to_string())
        .map_err(|e| NativeError::Type(format!("{what}: dtype: {e}")))
}

/// A contiguous `t`'s shape and its byte size at `elem` bytes an element.
fn contiguous_shape(t: &Bound<'_, PyAny>, what: &str, elem: usize) -> NResult<(Vec<usize>, usize)> {
    if !call0::<bool>(t, "is_contiguous", what)? {
        return Err(NativeError::Input(format!(
            "{what} is not contiguous: pass .contiguous()"
        )));
    }
    let shape: Vec<usize> = attr(t, "shape", what)?
        .extract()
        .map_err(|e| NativeError::Type(format!("{what}: shape: {e}")))?;
    let nbytes = shape
        .iter()
        .try_fold(elem, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| NativeError::Input(format!("{what}: shape {shape:?} overflows")))?;
    Ok((shape, nbytes))
}

/// `t`'s address, which must not be null where it holds `nbytes > 0`.
fn data_ptr(t: &Bound<'_, PyAny>, what: &str, nbytes: usize) -> NResult<usize> {
    let ptr: usize = call0(t, "data_ptr", what)?;
    if nbytes > 0 && ptr == 0 {
        return Err(NativeError::Input(format!(
            "{what} has no data (a null data_ptr)"
        )));
    }
    Ok(ptr)
}

/// The integer dtypes of index and result operands, which no safetensors dtype names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IntDType {
    I32,
    I64,
}

impl IntDType {
    fn torch_name(self) -> &'static str {
        match self {
            IntDType::I32 => "torch.int32",
            IntDType::I64 => "torch.int64",
        }
    }

    fn size(self) -> usize {
        match self {
            IntDType::I32 => 4,
            IntDType::I64 => 8,
        }
    }
}

/// An integer tensor's address, shape and byte size (contiguous and strided, on any
/// device): index and result operands of the CUDA ops.
pub fn int_memory(
    t: &Bound<'_, PyAny>,
    what: &str,
    int: IntDType,
) -> NResult<(usize, Vec<usize>, usize)> {
    let dtype = dtype_name(t, what)?;
    if dtype != int.torch_name() {
        return Err(NativeError::Type(format!(
            "{what}: dtype {dtype} where {} is expected",
            int.torch_name()
        )));
    }
    strided(t, what)?;
    let (shape, nbytes) = contiguous_shape(t, what, int.size())?;
    Ok((data_ptr(t, what, nbytes)?, shape, nbytes))
}

/// The tensors as one safetensors image (header, then each tensor's bytes in order): the
/// one copy out of torch's memory. The caller holds the tensors (and the GIL) while this
/// runs, so no Python code frees or resizes them under the copy.
pub fn safetensors_image(tensors: &[TorchTensor]) -> Vec<u8> {
    let entries: Vec<(String, DType, Vec<usize>)> = tensors
        .iter()
        .map(|t| (t.name.clone(), t.dtype, t.shape.clone()))
        .collect();
    let (header, data_len) = build_header(&entries);
    let mut image = Vec::with_capacity(header.len() + data_len);
    image.extend_from_slice(&header);
    for t in tensors {
        if t.nbytes == 0 {
            continue;
        }
        // SAFETY: `describe` checked that the tensor is a live, contiguous CPU tensor whose
        // `data_ptr()` addresses `numel × element_size` = `nbytes` bytes; the caller keeps a
        // reference to it and holds the GIL, so it is neither freed nor resized meanwhile.
        let bytes = unsafe { std::slice::from_raw_parts(t.ptr as *const u8, t.nbytes) };
        image.extend_from_slice(bytes);
    }
    image
}
