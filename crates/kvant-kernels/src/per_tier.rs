//! [`per_tier!`](crate::per_tier): one generic body compiled once per SIMD
//! tier and dispatched on the tier at run time.
//!
//! A kernel written as plain Rust over slices, generic over how it
//! multiplies and adds ([`Fma`](crate::vecops::Fma), or a kernel's own
//! trait with a scalar and a vector implementation), vectorizes to the
//! width of whatever features the function it is inlined into enables. The
//! macro writes that function for each tier — AVX2 (with FMA and F16C,
//! which the AVX2 tier guarantees) and AVX-512 (F, BW, VL besides) — and a
//! safe entry that lowers the caller's tier with [`cpu::clamp`](crate::cpu::clamp)
//! before calling one of them, which is what makes the calls sound. The
//! scalar tier runs the body as is. Bodies should be `#[inline(always)]` so
//! that each copy is compiled with its tier's features; the entry itself
//! costs one tier comparison per call.

/// Defines functions that run a body on the caller's SIMD tier.
///
/// ```ignore
/// kvant_kernels::per_tier! {
///     /// `y += a·x`.
///     pub fn axpy_with(tier: SimdTier, a: f32, x: &[f32], y: &mut [f32]) [F = Plain, Fused] {
///         axpy_body::<F>(a, x, y)
///     }
/// }
/// ```
///
/// defines `axpy_with(tier, a, x, y)`: inside the body `F` names the
/// first type (here [`Plain`](crate::vecops::Plain)) on the scalar tier and
/// the second ([`Fused`](crate::vecops::Fused)) on AVX2 and AVX-512, whose
/// copies are compiled with those features enabled; a body that needs no
/// such type leaves the brackets out. Generic parameters take one bound
/// each (`<E: Elem>`); argument types may use them.
#[macro_export]
macro_rules! per_tier {
    ($(
        $(#[$attr:meta])*
        $vis:vis fn $name:ident $(<$($g:ident: $b:path),+>)?
            ($tier:ident: SimdTier $(, $arg:ident: $ty:ty)* $(,)?) $(-> $ret:ty)?
            $([$f:ident = $scalar:ty, $simd:ty])?
            $body:block
    )*) => {$(
        $(#[$attr])*
        #[allow(clippy::too_many_arguments)]
        $vis fn $name $(<$($g: $b),+>)? (
            $tier: $crate::cpu::SimdTier $(, $arg: $ty)*
        ) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2,fma,f16c")]
                #[allow(clippy::too_many_arguments)]
                fn tier_avx2 $(<$($g: $b),+>)? ($($arg: $ty),*) $(-> $ret)? {
                    $(type $f = $simd;)?
                    $body
                }
                #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
                #[allow(clippy::too_many_arguments)]
                fn tier_avx512 $(<$($g: $b),+>)? ($($arg: $ty),*) $(-> $ret)? {
                    $(type $f = $simd;)?
                    $body
                }
                match $crate::cpu::clamp($tier) {
                    // SAFETY: the clamped tier is one the CPU supports:
                    // AVX-512 F/BW/VL besides AVX2, FMA and F16C.
                    $crate::cpu::SimdTier::Avx512 => return unsafe { tier_avx512($($arg),*) },
                    // SAFETY: as above, AVX2 with FMA and F16C.
                    $crate::cpu::SimdTier::Avx2 => return unsafe { tier_avx2($($arg),*) },
                    _ => {}
                }
            }
            let _ = $tier;
            {
                $(type $f = $scalar;)?
                $body
            }
        }
    )*};
}
