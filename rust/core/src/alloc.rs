//! Fallible allocation for sizes a caller chose.
//!
//! `Vec::with_capacity`, `vec![x; n]` and `extend` abort the process when the allocator refuses.
//! Every buffer whose size follows from an argument (a padding length or multiple, a repeat
//! count, a shard or rank count) is sized here instead: its total is computed with checked
//! arithmetic first, then the whole total is requested at once, then each buffer is reserved
//! fallibly, and a refusal is the caller's typed error naming the argument. Buffers sized by
//! data the caller already holds (one entry per item, per token) need none of this.
use crate::error::{CoreError, CoreResult};

/// Bytes of `len` values of `T`, or `None` past `isize::MAX` (no buffer can be larger).
#[must_use]
pub fn bytes_of<T>(len: usize) -> Option<usize> {
    len.checked_mul(size_of::<T>())
        .filter(|&b| isize::try_from(b).is_ok())
}

/// Ask for `bytes` in one request and give them back. An allocator that checks each request
/// against the machine's memory (Linux's default overcommit heuristic) passes every one of
/// several buffers that together cannot exist; asking for their total first refuses that
/// before anything is written.
///
/// # Errors
/// `err()` when `bytes` is `None` (the total overflowed) or the allocator refuses.
pub fn probe(bytes: Option<usize>, err: impl Fn() -> CoreError) -> CoreResult<()> {
    let bytes = bytes.ok_or_else(&err)?;
    let mut v: Vec<u8> = Vec::new();
    v.try_reserve_exact(bytes).map_err(|_| err())
}

/// An empty `Vec` with room for `len` values.
///
/// # Errors
/// `err()` when the allocator refuses.
pub fn vec_with_capacity<T>(len: usize, err: impl Fn() -> CoreError) -> CoreResult<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(len).map_err(|_| err())?;
    Ok(v)
}

/// A copy of `values`, or `err()` when the allocator refuses (a copy of a buffer the caller
/// made from a size, such as the zeroed row offsets of `num_rows` empty rows).
///
/// # Errors
/// `err()` when the allocator refuses.
pub fn try_to_vec<T: Copy>(values: &[T], err: impl Fn() -> CoreError) -> CoreResult<Vec<T>> {
    let mut v = vec_with_capacity(values.len(), err)?;
    v.extend_from_slice(values);
    Ok(v)
}

/// Sum of `parts`, each `(len, bytes per value)`, or `None` on overflow.
#[must_use]
pub fn total_bytes(parts: &[(usize, usize)]) -> Option<usize> {
    parts.iter().try_fold(0usize, |acc, &(len, size)| {
        acc.checked_add(len.checked_mul(size)?)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused() -> CoreError {
        CoreError::IndexOverflow { what: "test" }
    }

    #[test]
    fn absurd_requests_are_errors_not_aborts() {
        assert_eq!(probe(None, refused), Err(refused()));
        // Past isize::MAX no allocator is asked at all; a Vec cannot be that large.
        assert_eq!(probe(Some(usize::MAX), refused), Err(refused()));
        assert!(vec_with_capacity::<u64>(usize::MAX / 4, refused).is_err());
        assert_eq!(bytes_of::<u64>(usize::MAX / 4), None);
        assert_eq!(total_bytes(&[(usize::MAX, 2)]), None);
        assert_eq!(total_bytes(&[(3, 8), (2, 1)]), Some(26));
    }

    #[test]
    fn small_requests_succeed() {
        assert_eq!(probe(Some(1 << 20), refused), Ok(()));
        let v = vec_with_capacity::<i64>(10, refused).unwrap_or_default();
        assert!(v.capacity() >= 10 && v.is_empty());
        assert_eq!(try_to_vec(&[1, 2, 3], refused), Ok(vec![1, 2, 3]));
    }
}
