//! Expected tensor shapes with named free sizes, checked once for every face that receives
//! tensors: the C ABI (DLPack and flat buffers) and the harness's `.npy` reader.
//!
//! Errors are [`Error::Shape`] naming the tensor, the expected shape (free names shown with the
//! size they were bound to) and the shape found.

use crate::error::{Error, Result};

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
}
