//! NumPy `.npy` tensor I/O for the op runner (`csa2 op`) and parity dumps, on the `npyz` crate.
//!
//! Every read checks dtype and shape (with the core's [`Dims`], the rule the C ABI uses too) and
//! names the file, the expected and the found value.

pub use csa2::shape::{Dim, Dims};
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

/// Element types the op runner reads and writes.
pub trait Element:
    npyz::Deserialize + npyz::Serialize + npyz::AutoSerialize + Copy + 'static
{
    /// NumPy dtype name used in messages (e.g. "float32").
    const NAME: &'static str;
}
impl Element for f32 {
    const NAME: &'static str = "float32";
}
impl Element for i32 {
    const NAME: &'static str = "int32";
}
impl Element for i64 {
    const NAME: &'static str = "int64";
}
impl Element for u8 {
    const NAME: &'static str = "uint8";
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
pub fn read<T: Element>(path: &Path) -> Result<Tensor<T>> {
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
            format!("expected dtype {}, found {} ({e})", T::NAME, dtype.descr()),
        )
    })?;
    Ok(Tensor { shape, data })
}

/// Reads `dir/name.npy` and checks its shape against `spec`.
pub fn read_checked<T: Element>(
    dir: &Path,
    name: &str,
    spec: &[Dim],
    dims: &mut Dims,
) -> Result<Tensor<T>> {
    let path = dir.join(format!("{name}.npy"));
    let t = read::<T>(&path)?;
    dims.check(&format!("{} ({})", path.display(), T::NAME), spec, &t.shape)?;
    Ok(t)
}

/// Like [`read_checked`], but `Ok(None)` when the file does not exist.
pub fn read_optional<T: Element>(
    dir: &Path,
    name: &str,
    spec: &[Dim],
    dims: &mut Dims,
) -> Result<Option<Tensor<T>>> {
    if dir.join(format!("{name}.npy")).exists() {
        read_checked(dir, name, spec, dims).map(Some)
    } else {
        Ok(None)
    }
}

/// Writes `data` with `shape` to `path` as a C-order little-endian `.npy`.
pub fn write<T: Element>(path: &Path, shape: &[usize], data: &[T]) -> Result<()> {
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
        let mut dims = Dims::default();
        assert!(
            read_checked::<f32>(dir.path(), "a", &[Dim::Any("T"), Dim::Fixed(3)], &mut dims)
                .is_ok()
        );
        assert_eq!(dims.get("T"), Some(2));
        let e = read_checked::<f32>(dir.path(), "a", &[Dim::Any("T"), Dim::Fixed(4)], &mut dims)
            .unwrap_err();
        assert!(e.to_string().contains("a.npy"), "{e}");
    }
}
