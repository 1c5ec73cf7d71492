//! Checked C ABI handles.
//!
//! A handle the C side holds (`Csa2Geometry *`, `Csa2Cache *`, `Csa2ReplayPlan *`,
//! `Csa2CompressorState *`) is **not an address**: it is an opaque 64-bit token, never
//! dereferenced, that names an entry of a process-wide registry (one per handle type):
//!
//! ```text
//! bits 63..56  type tag (one per handle type, never 0)
//! bits 55..0   id, from one process-wide counter that starts at 1 and never repeats
//! ```
//!
//! Every call looks the token up (`parking_lot::RwLock` read + a B-tree lookup) and works on an
//! `Arc` of the object, so:
//! - a double free, a use after free, a handle of another type, null or any garbage value is
//!   refused with `CSA2_ERR_INVALID_HANDLE` (null: `CSA2_ERR_NULL_POINTER`) — never undefined
//!   behaviour, because no caller-supplied value is ever turned into a reference;
//! - ids are never reused (2^56 creations would be needed to wrap), so a stale token can never
//!   name a newer object: this is the generation check of a generational slot map without slots;
//! - a `_free` racing another call on the same handle is safe: the registry entry goes at once
//!   (later calls are refused), the object itself when the last in-flight call drops its `Arc`.
//!
//! Why a registry rather than a tagged header in the allocation: checking a header means reading
//! memory the caller names, which after a free is undefined behaviour however the check turns out.

use crate::error::{Error, Result};
use parking_lot::RwLock;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

#[cfg(not(target_pointer_width = "64"))]
compile_error!("csa2 handles are 64-bit tokens: a 64-bit target is required");

const ID_BITS: u32 = 56;
const ID_MASK: u64 = (1 << ID_BITS) - 1;

/// One counter for every handle type, so two live handles never share an id.
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// The live objects of one handle type, by id.
pub(crate) struct Registry<T> {
    live: RwLock<BTreeMap<u64, Arc<T>>>,
}

impl<T> Registry<T> {
    pub(crate) const fn new() -> Registry<T> {
        Registry {
            live: RwLock::new(BTreeMap::new()),
        }
    }
}

/// An object the C side holds by handle.
pub(crate) trait Handle: Sized + Send + Sync + 'static {
    /// The C type name, for messages (`"Csa2Cache"`).
    const NAME: &'static str;
    /// The type tag in bits 63..56 of the token (distinct per type, never 0).
    const TAG: u8;
    /// This type's registry.
    fn registry() -> &'static Registry<Self>;
}

/// The handle type whose tag is `tag`, for "a Csa2Geometry passed as a Csa2Cache" messages.
fn tag_name(tag: u8) -> Option<&'static str> {
    use super::{
        Csa2Cache, Csa2Clock, Csa2CompressorState, Csa2DramPool, Csa2Engine, Csa2Geometry,
        Csa2ReplayPlan, Csa2SsdStore,
    };
    [
        (Csa2Engine::TAG, Csa2Engine::NAME),
        (Csa2Clock::TAG, Csa2Clock::NAME),
        (Csa2SsdStore::TAG, Csa2SsdStore::NAME),
        (Csa2DramPool::TAG, Csa2DramPool::NAME),
        (Csa2Geometry::TAG, Csa2Geometry::NAME),
        (Csa2Cache::TAG, Csa2Cache::NAME),
        (Csa2ReplayPlan::TAG, Csa2ReplayPlan::NAME),
        (Csa2CompressorState::TAG, Csa2CompressorState::NAME),
    ]
    .iter()
    .find(|(t, _)| *t == tag)
    .map(|(_, n)| *n)
}

/// Registers `v` and returns its token as the C pointer type.
pub(crate) fn register<T: Handle>(v: T) -> Result<*mut T> {
    let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    if id > ID_MASK {
        return Err(Error::Internal(format!(
            "{}: handle ids exhausted ({id} created)",
            T::NAME
        )));
    }
    T::registry().live.write().insert(id, Arc::new(v));
    let token = (u64::from(T::TAG) << ID_BITS) | id;
    // A token, never dereferenced: no provenance needed.
    Ok(std::ptr::without_provenance_mut(token as usize))
}

/// The id of a token of type `T`, or why it is not one. `what` names the argument.
fn decode<T: Handle>(p: *const T, what: &'static str) -> Result<u64> {
    if p.is_null() {
        return Err(Error::NullPointer(what));
    }
    let token = p.addr() as u64;
    let tag = (token >> ID_BITS) as u8;
    if tag != T::TAG {
        return Err(Error::InvalidHandle(match tag_name(tag) {
            Some(other) => format!("`{what}` is a {other} handle, expected a {}", T::NAME),
            None => format!(
                "`{what}` = {token:#x} is not a {} handle (garbage value)",
                T::NAME
            ),
        }));
    }
    Ok(token & ID_MASK)
}

fn stale<T: Handle>(what: &'static str, p: *const T) -> Error {
    Error::InvalidHandle(format!(
        "`{what}` = {:#x} is a {} handle that was freed or never created",
        p.addr(),
        T::NAME
    ))
}

/// The live object behind handle `p`.
///
/// Errors: [`Error::NullPointer`] for null, [`Error::InvalidHandle`] for anything that is not a
/// live handle of type `T`.
pub(crate) fn get<T: Handle>(p: *const T, what: &'static str) -> Result<Arc<T>> {
    let id = decode(p, what)?;
    T::registry()
        .live
        .read()
        .get(&id)
        .cloned()
        .ok_or_else(|| stale(what, p))
}

/// Unregisters handle `p` (the object is dropped once no call holds it). Null is a no-op.
///
/// Errors: [`Error::InvalidHandle`] (double free, garbage, another type).
pub(crate) fn free<T: Handle>(p: *mut T, what: &'static str) -> Result<()> {
    if p.is_null() {
        return Ok(());
    }
    let id = decode(p.cast_const(), what)?;
    let obj = T::registry().live.write().remove(&id);
    // Dropped here, outside the registry lock: a cache's drop frees every slab.
    obj.map(drop).ok_or_else(|| stale(what, p.cast_const()))
}

fn live_count<T: Handle>() -> usize {
    T::registry().live.read().len()
}

/// Live handles of every type now (created and not yet freed), for leak checks in tests and
/// fuzzing. Not exported over the C ABI.
pub fn live_handles() -> usize {
    use super::{
        Csa2Cache, Csa2Clock, Csa2CompressorState, Csa2DramPool, Csa2Engine, Csa2Geometry,
        Csa2ReplayPlan, Csa2SsdStore,
    };
    live_count::<Csa2Engine>()
        + live_count::<Csa2Clock>()
        + live_count::<Csa2SsdStore>()
        + live_count::<Csa2DramPool>()
        + live_count::<Csa2Geometry>()
        + live_count::<Csa2Cache>()
        + live_count::<Csa2ReplayPlan>()
        + live_count::<Csa2CompressorState>()
}

#[cfg(test)]
mod tests {
    use super::*;

    struct A;
    struct B;
    static RA: Registry<A> = Registry::new();
    static RB: Registry<B> = Registry::new();
    impl Handle for A {
        const NAME: &'static str = "A";
        const TAG: u8 = 0xA1;
        fn registry() -> &'static Registry<A> {
            &RA
        }
    }
    impl Handle for B {
        const NAME: &'static str = "B";
        const TAG: u8 = 0xA2;
        fn registry() -> &'static Registry<B> {
            &RB
        }
    }

    #[test]
    fn tokens_are_checked_for_type_liveness_and_garbage() {
        let a = register(A).unwrap();
        assert!(get(a, "a").is_ok());
        let as_b = a.cast::<B>();
        assert!(matches!(get(as_b, "b"), Err(Error::InvalidHandle(_))));
        let garbage = std::ptr::without_provenance::<A>(0xdead_beef);
        assert!(matches!(get(garbage, "a"), Err(Error::InvalidHandle(_))));
        assert!(matches!(
            get::<A>(std::ptr::null(), "a"),
            Err(Error::NullPointer(_))
        ));
        free(a, "a").unwrap();
        assert!(matches!(get(a, "a"), Err(Error::InvalidHandle(_))));
        assert!(matches!(free(a, "a"), Err(Error::InvalidHandle(_))));
        free::<A>(std::ptr::null_mut(), "a").unwrap();
        // Never reused: a new object gets a new token.
        let a2 = register(A).unwrap();
        assert_ne!(a2, a);
        assert!(get(a, "a").is_err());
        free(a2, "a").unwrap();
    }
}
