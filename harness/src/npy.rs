//! NumPy `.npy` tensor I/O for the op runner (`csa2 op`) and parity dumps, on the `npyz` crate.
//!
//! Every read checks dtype and shape and names the file, the expected and the found value.

use crate::error::{Error, Result};
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

/// One dimension of an expected shape: a fixed size, or a named free size bound on first use.
#[derive(Debug, Clone, Copy)]
pub enum Dim {
    /// Must equal this size.
    Fixed(usize),
    /// Any size; every `Any` with the same name must agree (checked by [`Dims`]).
    Any(&'static str),
}

/// Binds free dimension names across several tensors (e.g. T in q [T,64,512] and positions [T]).
#[derive(Debug, Default)]
pub struct Dims(std::collections::BTreeMap<&'static str, usize>);

impl Dims {
    /// The size bound to `name`, if any tensor bound it.
    pub fn get(&self, name: &str) -> Option<usize> {
        self.0.get(name).copied()
    }
    /// Binds `name` to `size` explicitly.
    pub fn bind(&mut self, name: &'static str, size: usize) {
        self.0.insert(name, size);
    }
    fn fmt_expected(&self, spec: &[Dim]) -> String {
        let parts: Vec<String> = spec
            .iter()
            .map(|d| match d {
                Dim::Fixed(n) => n.to_string(),
                Dim::Any(s) => self.get(s).map_or(s.to_string(), |v| format!("{s}={v}")),
            })
            .collect();
        format!("[{}]", parts.join(", "))
    }
    /// Checks `shape` against `spec`, binding free names; errors name `what`.
    pub fn check(&mut self, what: &str, spec: &[Dim], shape: &[usize]) -> Result<()> {
        let expected = self.fmt_expected(spec);
        let bad = || Error::shape(what.to_string(), expected.clone(), format!("{shape:?}"));
        if spec.len() != shape.len() {
            return Err(bad());
        }
        for (d, &s) in spec.iter().zip(shape) {
            match *d {
                Dim::Fixed(n) if n != s => return Err(bad()),
                Dim::Any(name) => match self.get(name) {
                    Some(v) if v != s => return Err(bad()),
                    Some(_) => {}
                    None => {
                        self.0.insert(name, s);
                    }
                },
                _ => {}
            }
        }
        Ok(())
    }
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
