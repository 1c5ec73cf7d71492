//! Op tensor signatures, declared once per op and checked by every face that receives tensors: the
//! C ABI (DLPack), the Rust view entries and the CLI's `.npy` reader.
//!
//! - [`Dim`]: one dimension of an expected shape — fixed, a named free size, or a multiple of one.
//! - [`Arg`]: one tensor argument of an op: its name (the C ABI's argument name), the element types
//!   it accepts, its shape and its [`Access`] (read, written, or both).
//! - [`Signature`]: an op's arguments, in call order.
//! - [`Dims`]: the sizes bound while one call's arguments are checked (T in q `[T, 64, 512]` must be
//!   T in positions `[T]`); sizes fixed by scalar parameters (a head count, a record width) are
//!   bound first with [`Dims::bind`].
//!
//! Each op family declares its signatures in `ops/<family>/mod.rs` (module `signature`); the record
//! rows of the cache exports in `formats/records.rs`. `Dim::` is written nowhere else (a test scans
//! the tree). Errors are [`Error::Shape`] naming the tensor, the expected shape (free names shown
//! with the size they were bound to) and the shape found.

use crate::error::{Error, Result};
use crate::tensor::DType;

/// One dimension of an expected shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dim {
    /// Must equal this size.
    Fixed(usize),
    /// Any size; every `Any` with the same name must agree (checked by [`Dims`]).
    Any(&'static str),
    /// `k ·` the size named (`hc_fn [24, 4·d]`); binds the name to `size / k` when it is unbound
    /// and `size` divides.
    Times(usize, &'static str),
}

/// How an op uses a tensor argument.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Read only.
    Read,
    /// Written only (its contents on entry are ignored).
    Write,
    /// Read and written in place.
    ReadWrite,
}

/// One tensor argument of an op's signature.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Arg {
    /// The argument's name: the C ABI parameter (or args-struct field) and the name errors use.
    pub name: &'static str,
    /// Element types accepted (floats are converted to f32 on entry where several are listed).
    pub dtypes: &'static [DType],
    /// Expected shape.
    pub dims: &'static [Dim],
    /// Read, written or both.
    pub access: Access,
    /// Whether a call may leave it out (a null pointer at the C ABI, a missing file for the CLI).
    pub optional: bool,
}

impl Arg {
    /// A required input.
    pub const fn read(name: &'static str, dtypes: &'static [DType], dims: &'static [Dim]) -> Arg {
        Arg {
            name,
            dtypes,
            dims,
            access: Access::Read,
            optional: false,
        }
    }
    /// A required output.
    pub const fn write(name: &'static str, dtypes: &'static [DType], dims: &'static [Dim]) -> Arg {
        Arg {
            access: Access::Write,
            ..Arg::read(name, dtypes, dims)
        }
    }
    /// A required tensor updated in place.
    pub const fn read_write(
        name: &'static str,
        dtypes: &'static [DType],
        dims: &'static [Dim],
    ) -> Arg {
        Arg {
            access: Access::ReadWrite,
            ..Arg::read(name, dtypes, dims)
        }
    }
    /// The same argument, allowed to be absent.
    pub const fn optional(self) -> Arg {
        Arg {
            optional: true,
            ..self
        }
    }

    /// Checks a tensor's dtype and shape against this argument, binding free names in `dims`;
    /// errors name `what` (the argument name, or a file for the CLI).
    ///
    /// Errors: [`Error::Shape`] with `what.dtype` for a dtype not accepted, `what` for the shape.
    pub fn check_as(
        &self,
        what: &str,
        dtype: DType,
        shape: &[usize],
        dims: &mut Dims,
    ) -> Result<()> {
        if !self.dtypes.contains(&dtype) {
            let names: Vec<&str> = self.dtypes.iter().map(|d| d.name()).collect();
            return Err(Error::shape(
                format!("{what}.dtype"),
                names.join(" or "),
                dtype.name(),
            ));
        }
        dims.check(what, self.dims, shape)
    }

    /// [`Arg::check_as`] naming the argument itself.
    pub fn check(&self, dtype: DType, shape: &[usize], dims: &mut Dims) -> Result<()> {
        self.check_as(self.name, dtype, shape, dims)
    }
}

/// An op's tensor arguments, in call order.
#[derive(Debug, Clone, Copy)]
pub struct Signature {
    /// The op (the C export without `csa2_`, or the library function).
    pub op: &'static str,
    /// Its tensor arguments.
    pub args: &'static [Arg],
}

impl Signature {
    /// The argument named `name`, if the op has one.
    pub fn arg(&self, name: &str) -> Option<&Arg> {
        self.args.iter().find(|a| a.name == name)
    }
}

/// Binds free dimension names across several tensors (e.g. T in q [T,64,512] and positions [T]).
#[derive(Debug, Default)]
pub struct Dims(std::collections::BTreeMap<&'static str, usize>);

impl Dims {
    /// The size bound to `name`, if any tensor bound it.
    pub fn get(&self, name: &str) -> Option<usize> {
        self.0.get(name).copied()
    }
    /// Binds `name` to a size a scalar parameter fixes (a head count, a record width), before the
    /// tensors are checked against it.
    pub fn bind(&mut self, name: &'static str, size: usize) {
        self.0.insert(name, size);
    }
    fn fmt_expected(&self, spec: &[Dim]) -> String {
        let parts: Vec<String> = spec
            .iter()
            .map(|d| match *d {
                Dim::Fixed(n) => n.to_string(),
                Dim::Any(s) => self.get(s).map_or(s.to_string(), |v| format!("{s}={v}")),
                Dim::Times(k, s) => self
                    .get(s)
                    .map_or(format!("{k}·{s}"), |v| format!("{k}·{s}={}", k * v)),
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
                Dim::Fixed(_) => {}
                Dim::Any(name) => match self.get(name) {
                    Some(v) if v != s => return Err(bad()),
                    Some(_) => {}
                    None => {
                        self.0.insert(name, s);
                    }
                },
                Dim::Times(k, name) => match self.get(name) {
                    Some(v) if v.checked_mul(k) != Some(s) => return Err(bad()),
                    Some(_) => {}
                    None if k == 0 || !s.is_multiple_of(k) => return Err(bad()),
                    None => {
                        self.0.insert(name, s / k);
                    }
                },
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A free name binds on first use and must agree afterwards; the error names the tensor, the
    /// expected shape with the bound size, and the shape found.
    #[test]
    fn free_names_bind_once_and_errors_name_both_shapes() {
        let mut d = Dims::default();
        let q = [Dim::Any("T"), Dim::Fixed(64), Dim::Fixed(512)];
        d.check("q", &q, &[3, 64, 512]).unwrap();
        assert_eq!(d.get("T"), Some(3));
        d.check("positions", &[Dim::Any("T")], &[3]).unwrap();
        let e = d.check("positions", &[Dim::Any("T")], &[4]).unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("positions") && msg.contains("T=3") && msg.contains("[4]"),
            "{msg}"
        );
        assert!(d.check("q", &q, &[3, 64]).is_err(), "rank mismatch");
        assert!(
            d.check("q", &q, &[3, 64, 511]).is_err(),
            "fixed size mismatch"
        );
    }

    /// `Times` binds its name by division, checks against a bound one, and shows the product.
    #[test]
    fn multiples_of_a_name_bind_and_check() {
        let mut d = Dims::default();
        let f = [Dim::Fixed(24), Dim::Times(4, "d")];
        d.check("hc_fn", &f, &[24, 256]).unwrap();
        assert_eq!(d.get("d"), Some(64));
        d.check("norm", &[Dim::Any("d")], &[64]).unwrap();
        let msg = d.check("hc_fn", &f, &[24, 255]).unwrap_err().to_string();
        assert!(
            msg.contains("4·d=256") && msg.contains("[24, 255]"),
            "{msg}"
        );
        let mut fresh = Dims::default();
        assert!(
            fresh.check("hc_fn", &f, &[24, 255]).is_err(),
            "not a multiple"
        );
        fresh.bind("h", 8);
        let e = fresh
            .check("sink", &[Dim::Any("h")], &[7])
            .unwrap_err()
            .to_string();
        assert!(e.contains("h=8") && e.contains("[7]"), "{e}");
    }

    /// An argument checks the dtype first, naming `what.dtype`, then the shape.
    #[test]
    fn args_check_dtype_then_shape() {
        const X: Arg = Arg::read(
            "x",
            &[DType::F32, DType::Bf16],
            &[Dim::Any("T"), Dim::Fixed(3)],
        );
        let mut d = Dims::default();
        X.check(DType::Bf16, &[2, 3], &mut d).unwrap();
        let e = X
            .check(DType::I32, &[2, 3], &mut d)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("x.dtype") && e.contains("float32 or bfloat16") && e.contains("int32"),
            "{e}"
        );
        let e = X
            .check(DType::F32, &[3, 3], &mut d)
            .unwrap_err()
            .to_string();
        assert!(e.contains("T=2") && e.contains("[3, 3]"), "{e}");
        assert!(X.optional().optional && !X.optional);
        const S: Signature = Signature {
            op: "op",
            args: &[X],
        };
        assert_eq!(S.arg("x"), Some(&X));
        assert!(S.arg("y").is_none());
    }
}
