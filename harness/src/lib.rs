//! # csa2-harness — measurements over the csa2 library
//!
//! What the CLI (`csa2 ab`, `run`, `trace`, `replay-error`, `check`, `op`, `bench`) and the
//! integration tests measure with, kept out of the library vLLM loads so that the cdylib carries
//! no measurement or CLI dependencies:
//!
//! - [`ab`]: the A/B driver (CSA2 vs launch day: bytes, decode, accuracy, prefill);
//! - [`gen`]: the seeded generators every op test, `csa2 check` and the benchmarks draw inputs from;
//! - [`npy`]: NumPy `.npy` I/O for `csa2 op` (shape rules from [`csa2::shape`]);
//! - [`reference`]: the f64 reference of a decode step (what `csa2 ab` measures accuracy against);
//! - [`replay_error`]: exact vs bounded replay, measured per layer and per turn;
//! - [`session`]: the multi-turn agentic session through the stack (`csa2 run`);
//! - [`sim`]: the trace-driven serving simulation (cache manager, tiers, replay planner on a
//!   virtual clock).
#![deny(missing_docs)]

pub mod ab;
pub mod gen;
pub mod npy;
pub mod reference;
pub mod replay_error;
pub mod session;
pub mod sim;
