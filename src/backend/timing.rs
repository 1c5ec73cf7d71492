//! Wall-time accounting of one or more steps, split by layer role and by op, so `csa2 ab` can say
//! where a decode step goes (projections vs indexer vs attention vs mHC vs codecs).

use crate::geometry::Role;
use std::time::{Duration, Instant};

/// The op buckets of the attention sublayer and its boundaries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Op {
    /// Dense projections (wq_a/wq_b, wkv, compressor, indexer Q/weights, wo_a/wo_b) and norms.
    Projections,
    /// RoPE (forward on Q/KV/index Q, inverse on the output).
    Rope,
    /// Compressor pooling + norm + index-K projection.
    Compressor,
    /// Record encode (cache writes) and decode (SWA window reads).
    Codecs,
    /// Indexer logits.
    Indexer,
    /// Top-k and candidate-pool selection.
    Topk,
    /// Sparse + window attention.
    Attention,
    /// mHC boundaries (post update, coefficients, collapse, norm).
    Mhc,
}

impl Op {
    /// All ops, in report order.
    pub const ALL: [Op; 8] = [
        Op::Projections,
        Op::Rope,
        Op::Compressor,
        Op::Codecs,
        Op::Indexer,
        Op::Topk,
        Op::Attention,
        Op::Mhc,
    ];
    /// Name used in tables and JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            Op::Projections => "projections",
            Op::Rope => "rope",
            Op::Compressor => "compressor",
            Op::Codecs => "codecs",
            Op::Indexer => "indexer",
            Op::Topk => "topk",
            Op::Attention => "attention",
            Op::Mhc => "mhc",
        }
    }
}

/// Roles in report order.
pub const ROLES: [Role; 4] = [Role::Full, Role::Reindex, Role::Reuse, Role::SwaOnly];

fn role_idx(r: Role) -> usize {
    ROLES
        .iter()
        .position(|&x| x == r)
        .expect("every role is listed")
}

/// Accumulated seconds per (role, op).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Timings {
    secs: [[f64; 8]; 4],
}

impl Timings {
    /// Adds `d` to (role, op).
    pub fn add(&mut self, role: Role, op: Op, d: Duration) {
        self.secs[role_idx(role)][op as usize] += d.as_secs_f64();
    }
    /// Runs `f`, charging its wall time to (role, op).
    pub fn time<T>(&mut self, role: Role, op: Op, f: impl FnOnce() -> T) -> T {
        let t = Instant::now();
        let r = f();
        self.add(role, op, t.elapsed());
        r
    }
    /// Seconds of (role, op).
    pub fn get(&self, role: Role, op: Op) -> f64 {
        self.secs[role_idx(role)][op as usize]
    }
    /// Seconds of a role over all ops.
    pub fn role_total(&self, role: Role) -> f64 {
        self.secs[role_idx(role)].iter().sum()
    }
    /// Seconds of an op over all roles.
    pub fn op_total(&self, op: Op) -> f64 {
        self.secs.iter().map(|r| r[op as usize]).sum()
    }
    /// Everything.
    pub fn total(&self) -> f64 {
        self.secs.iter().flatten().sum()
    }
    /// Everything but `op` (e.g. the step without its dense projections, which are the same work
    /// in every backend and hide the attention-side differences an A/B is after).
    pub fn total_without(&self, op: Op) -> f64 {
        self.total() - self.op_total(op)
    }
    /// Adds another accumulator.
    pub fn merge(&mut self, o: &Timings) {
        for (a, b) in self.secs.iter_mut().zip(&o.secs) {
            for (x, y) in a.iter_mut().zip(b) {
                *x += y;
            }
        }
    }
    /// Divides every entry by `n` (per-step averages).
    pub fn scaled(&self, f: f64) -> Timings {
        let mut t = self.clone();
        t.secs.iter_mut().flatten().for_each(|v| *v *= f);
        t
    }
    /// JSON object `{role: {op: seconds}}` plus totals (`total`, and `total_without_projections`).
    pub fn to_json(&self) -> serde_json::Value {
        let mut by_role = serde_json::Map::new();
        for r in ROLES {
            let mut m = serde_json::Map::new();
            for op in Op::ALL {
                m.insert(op.as_str().into(), self.get(r, op).into());
            }
            m.insert("total".into(), self.role_total(r).into());
            by_role.insert(r.as_str().into(), m.into());
        }
        let mut by_op = serde_json::Map::new();
        for op in Op::ALL {
            by_op.insert(op.as_str().into(), self.op_total(op).into());
        }
        serde_json::json!({
            "by_role": by_role,
            "by_op": by_op,
            "total": self.total(),
            "total_without_projections": self.total_without(Op::Projections),
        })
    }
}
