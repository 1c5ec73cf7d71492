//! NumPy `.npy` tensor I/O for the op runner (`csa2 op`) and parity dumps, on the `npyz` crate.
//!
//! Every read checks dtype and shape against an argument of the op's signature (the core's
//! [`Arg`] and [`Dims`], the rule the C ABI uses too) and names the file, the expected and the
//! found value.

pub use csa2::shape::{Arg, Dims};
use csa2::{Error, Result};
use npyz::WriterBuilder;
use std::path::{Path, PathBuf};

/// A dense row-major tensor read from or written to `.npy`.
#[derive(Debug, Clone, PartialEq)]
pub struct Tensor<T> {
    /// Shape, outermost first.
    pub shape: Vec<usize>,
    /// Elements in C order.
    pub data: Vec<T>,
}

/// Element types the op runner reads and writes: the core's tensor element types (their
/// [`csa2::tensor::Element::DTYPE`] names the NumPy spelling) that npyz can read and write.
pub trait NpyElement:
    csa2::tensor::Element + npyz::Deserialize + npyz::Serialize + npyz::AutoSerialize
{
}
impl<T> NpyElement for T where
    T: csa2::tensor::Element + npyz::Deserialize + npyz::Serialize + npyz::AutoSerialize
{
}

fn parse_err(path: &Path, reason: impl Into<String>) -> Error {
    Error::Parse {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

/// Reads `path` as a C-order `.npy` of element type `T`.
///
/// Errors: [`Error::Io`] when unreadable, [`Error::Parse`] when not a `.npy`, Fortran-ordered, or of
/// another dtype (the message names the dtype found).
pub fn read<T: NpyElement>(path: &Path) -> Result<Tensor<T>> {
    let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
    let npy = npyz::NpyFile::new(&bytes[..]).map_err(|e| parse_err(path, e.to_string()))?;
    if npy.order() != npyz::Order::C {
        return Err(parse_err(
            path,
            "Fortran-ordered arrays are not supported; save with np.ascontiguousarray",
        ));
    }
    let shape: Vec<usize> = npy.shape().iter().map(|&d| d as usize).collect();
    let dtype = npy.dtype();
    let data = npy.into_vec::<T>().map_err(|e| {
        parse_err(
            path,
            format!(
                "expected dtype {}, found {} ({e})",
                T::DTYPE.name(),
                dtype.descr()
            ),
        )
    })?;
    Ok(Tensor { shape, data })
}

/// Reads `dir/<arg.name>.npy` and checks it against `arg` of an op's signature.
///
/// Errors: those of [`read`]; [`Error::Shape`] naming the file and its dtype, the expected shape
/// (with bound sizes) and the one found; [`Error::Internal`] when `T` is not a dtype `arg` accepts
/// (a runner bug, not an input error).
pub fn read_arg<T: NpyElement>(dir: &Path, arg: &Arg, dims: &mut Dims) -> Result<Tensor<T>> {
    read_file_as(dir, arg.name, arg, dims)
}

/// [`read_arg`] for a file named differently from the argument: `csa2 op` keeps the file names of
/// its documented contract (docs/OPS.md), e.g. `k_mxfp4.npy` for the indexer's `keys` records.
pub fn read_file_as<T: NpyElement>(
    dir: &Path,
    file: &str,
    arg: &Arg,
    dims: &mut Dims,
) -> Result<Tensor<T>> {
    if !arg.dtypes.contains(&T::DTYPE) {
        return Err(Error::Internal(format!(
            "`{}` is read as {}, which its signature does not accept",
            arg.name,
            T::DTYPE.name()
        )));
    }
    let path = dir.join(format!("{file}.npy"));
    let t = read::<T>(&path)?;
    dims.check(
        &format!("{} ({})", path.display(), T::DTYPE.name()),
        arg.dims,
        &t.shape,
    )?;
    Ok(t)
}

/// [`read_file_as`], but `Ok(None)` when the file does not exist.
pub fn read_file_optional<T: NpyElement>(
    dir: &Path,
    file: &str,
    arg: &Arg,
    dims: &mut Dims,
) -> Result<Option<Tensor<T>>> {
    if dir.join(format!("{file}.npy")).exists() {
        read_file_as(dir, file, arg, dims).map(Some)
    } else {
        Ok(None)
    }
}

/// [`read_arg`], but `Ok(None)` when the file does not exist.
pub fn read_arg_optional<T: NpyElement>(
    dir: &Path,
    arg: &Arg,
    dims: &mut Dims,
) -> Result<Option<Tensor<T>>> {
    read_file_optional(dir, arg.name, arg, dims)
}

/// Writes `data` with `shape` to `path` as a C-order little-endian `.npy`.
pub fn write<T: NpyElement>(path: &Path, shape: &[usize], data: &[T]) -> Result<()> {
    let n: usize = shape.iter().product();
    if n != data.len() {
        return Err(Error::shape(
            format!("{} data", path.display()),
            n,
            data.len(),
        ));
    }
    let io = |e: std::io::Error| Error::io(PathBuf::from(path), e);
    let file = std::fs::File::create(path).map_err(io)?;
    let mut w = npyz::WriteOptions::new()
        .default_dtype()
        .shape(&shape.iter().map(|&d| d as u64).collect::<Vec<_>>())
        .writer(std::io::BufWriter::new(file))
        .begin_nd()
        .map_err(io)?;
    w.extend(data.iter().copied()).map_err(io)?;
    w.finish().map_err(io)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip_and_shape_errors() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.npy");
        write(&p, &[2, 3], &[1f32, 2., 3., 4., 5., 6.]).unwrap();
        let t = read::<f32>(&p).unwrap();
        assert_eq!(t.shape, vec![2, 3]);
        assert_eq!(t.data[5], 6.0);
        assert!(read::<i32>(&p).is_err());
        // topk's logits [T, N] bind T = 2; mHC's pre_prev [T, 4] then fails, naming the file.
        let mut dims = Dims::default();
        let logits = &csa2::ops::topk::signature::LOGITS;
        assert!(read_file_as::<f32>(dir.path(), "a", logits, &mut dims).is_ok());
        assert_eq!(dims.get("T"), Some(2));
        let pre = &csa2::ops::mhc::signature::PRE_PREV;
        let e = read_file_as::<f32>(dir.path(), "a", pre, &mut dims).unwrap_err();
        let e = e.to_string();
        assert!(
            e.contains("a.npy (float32)") && e.contains("[T=2, 4]") && e.contains("[2, 3]"),
            "{e}"
        );
        assert!(read_file_optional::<f32>(dir.path(), "b", pre, &mut dims)
            .unwrap()
            .is_none());
        // Reading as a dtype the argument does not accept is a runner bug.
        let e = read_file_as::<i32>(dir.path(), "a", logits, &mut dims).unwrap_err();
        assert!(matches!(e, Error::Internal(_)), "{e:?}");
    }
}
