//! torch tensors seen as Rust slices, without copies.
//!
//! The package does not link libtorch (one abi3 wheel serves every torch
//! version): a tensor is read through its Python attributes (`device`,
//! `dtype`, `shape`, `stride()`, `data_ptr()`), checked here, and its
//! memory borrowed as a slice for the length of one kernel call. Every
//! check a kernel's soundness rests on is made here, on the Rust side, so
//! calling `kvant._kvant` directly with the wrong tensors raises a Python
//! exception rather than reading out of bounds:
//! - the device is the CPU and the dtype the one the call expects;
//! - the memory is dense (contiguous, or for [`Tensors::strided`] rows of
//!   contiguous elements the kernel checks for overlap itself);
//! - no tensor written by a call overlaps any other tensor of the call
//!   (Rust's `&mut` must be exclusive, and a kernel reading its own output
//!   would give wrong gradients silently).

use kvant_kernels::KernelError;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;

/// The element types the bindings accept.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dt {
    F32,
    Bf16,
    I64,
}

impl Dt {
    fn parse(s: &str) -> Option<Dt> {
        match s {
            "torch.float32" => Some(Dt::F32),
            "torch.bfloat16" => Some(Dt::Bf16),
            "torch.int64" => Some(Dt::I64),
            _ => None,
        }
    }

    fn bytes(self) -> usize {
        match self {
            Dt::F32 => 4,
            Dt::Bf16 => 2,
            Dt::I64 => 8,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Dt::F32 => "float32",
            Dt::Bf16 => "bfloat16",
            Dt::I64 => "int64",
        }
    }
}

/// One tensor of a call: where its memory is and what it holds.
#[derive(Clone, Debug)]
pub struct View {
    pub name: &'static str,
    pub dt: Dt,
    pub shape: Vec<usize>,
    pub strides: Vec<usize>,
    /// Elements from the first to one past the last addressed element.
    pub span: usize,
    ptr: usize,
    writable: bool,
}

impl View {
    /// The last dimension (1 for a 0-d tensor).
    pub fn last(&self) -> usize {
        self.shape.last().copied().unwrap_or(1)
    }

    fn byte_range(&self) -> (usize, usize) {
        (self.ptr, self.ptr + self.span * self.dt.bytes())
    }

    pub fn expect(&self, dt: Dt) -> PyResult<&Self> {
        if self.dt == dt {
            Ok(self)
        } else {
            Err(PyTypeError::new_err(format!(
                "{} must be {}, got {}",
                self.name,
                dt.name(),
                self.dt.name()
            )))
        }
    }

    /// The tensor's memory as `&[E]`.
    ///
    /// # Safety
    /// `E` is the Rust type of `self.dt`, and the tensor stays alive and
    /// unresized for the borrow (the caller holds it for one kernel call).
    pub unsafe fn slice<E>(&self) -> &[E] {
        debug_assert_eq!(std::mem::size_of::<E>(), self.dt.bytes());
        if self.span == 0 {
            return &[];
        }
        // SAFETY: `ptr` is the tensor's data pointer (non-null for a
        // non-empty CPU tensor, aligned to its element type by torch's
        // allocator) and `span` elements from it belong to the tensor
        // (checked from its shape and strides in `Tensors::view`).
        unsafe { std::slice::from_raw_parts(self.ptr as *const E, self.span) }
    }

    /// The tensor's memory as `&mut [E]`.
    ///
    /// # Safety
    /// As [`View::slice`], and the view was taken with [`Tensors::out`]
    /// (so no other view of the call overlaps it).
    #[allow(clippy::mut_from_ref)] // exclusivity is checked by `Tensors::checked`
    pub unsafe fn slice_mut<E>(&self) -> &mut [E] {
        debug_assert!(self.writable);
        debug_assert_eq!(std::mem::size_of::<E>(), self.dt.bytes());
        if self.span == 0 {
            return &mut [];
        }
        // SAFETY: as `slice`, plus no other live view overlaps these bytes
        // (`Tensors::checked` rejects overlaps with a written view).
        unsafe { std::slice::from_raw_parts_mut(self.ptr as *mut E, self.span) }
    }
}

/// The tensors of one call, collected so overlaps can be checked at once.
#[derive(Default)]
pub struct Tensors {
    views: Vec<View>,
}

impl Tensors {
    pub fn new() -> Self {
        Self::default()
    }

    fn view(
        &mut self,
        obj: &Bound<'_, PyAny>,
        name: &'static str,
        writable: bool,
        dense: bool,
    ) -> PyResult<View> {
        let not_a_tensor = || {
            let ty = obj
                .get_type()
                .name()
                .map_or_else(|_| "?".to_string(), |n| n.to_string());
            PyTypeError::new_err(format!("{name} must be a torch.Tensor, got {ty}"))
        };
        let device: String = obj
            .getattr("device")
            .and_then(|d| d.getattr("type"))
            .and_then(|t| t.extract())
            .map_err(|_| not_a_tensor())?;
        if device != "cpu" {
            return Err(PyValueError::new_err(format!(
                "{name} is on {device}; kvant's kernels run on the CPU"
            )));
        }
        let dtype: String = obj.getattr("dtype")?.str()?.extract()?;
        let dt = Dt::parse(&dtype).ok_or_else(|| {
            PyTypeError::new_err(format!(
                "{name} has dtype {dtype}; kvant takes float32 and bfloat16 (int64 for indices)"
            ))
        })?;
        let shape: Vec<usize> = obj.getattr("shape")?.extract()?;
        let strides: Vec<isize> = obj.call_method0("stride")?.extract()?;
        let ptr: usize = obj.call_method0("data_ptr")?.extract()?;
        let numel = shape
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .ok_or_else(|| PyValueError::new_err(format!("{name}: size overflows")))?;
        let strides: Vec<usize> = strides
            .iter()
            .map(|&s| usize::try_from(s))
            .collect::<Result<_, _>>()
            .map_err(|_| PyValueError::new_err(format!("{name} has a negative stride")))?;
        // Elements from the first to one past the last addressed one.
        let span = if numel == 0 {
            0
        } else {
            shape
                .iter()
                .zip(&strides)
                .try_fold(1usize, |a, (&d, &s)| {
                    (d - 1).checked_mul(s).and_then(|x| x.checked_add(a))
                })
                .ok_or_else(|| PyValueError::new_err(format!("{name}: size overflows")))?
        };
        if dense {
            let contiguous: bool = obj.call_method0("is_contiguous")?.extract()?;
            if !contiguous {
                return Err(PyValueError::new_err(format!(
                    "{name} must be contiguous (call .contiguous() first)"
                )));
            }
        } else if shape.last().is_some_and(|&d| d > 1) && strides.last() != Some(&1) {
            return Err(PyValueError::new_err(format!(
                "{name}'s last dimension must be contiguous (stride 1)"
            )));
        }
        if numel > 0 && (ptr == 0 || !ptr.is_multiple_of(dt.bytes())) {
            return Err(PyValueError::new_err(format!(
                "{name}'s data pointer is not aligned to its element type"
            )));
        }
        let v = View {
            name,
            dt,
            shape,
            strides,
            span,
            ptr,
            writable,
        };
        self.views.push(v.clone());
        Ok(v)
    }

    /// A contiguous tensor the call reads.
    pub fn input(&mut self, obj: &Bound<'_, PyAny>, name: &'static str) -> PyResult<View> {
        self.view(obj, name, false, true)
    }

    /// [`Tensors::input`] for an optional argument.
    pub fn input_opt(
        &mut self,
        obj: Option<&Bound<'_, PyAny>>,
        name: &'static str,
    ) -> PyResult<Option<View>> {
        obj.map(|o| self.input(o, name)).transpose()
    }

    /// A contiguous tensor the call writes.
    pub fn out(&mut self, obj: &Bound<'_, PyAny>, name: &'static str) -> PyResult<View> {
        self.view(obj, name, true, true)
    }

    /// [`Tensors::out`] for an optional argument.
    pub fn out_opt(
        &mut self,
        obj: Option<&Bound<'_, PyAny>>,
        name: &'static str,
    ) -> PyResult<Option<View>> {
        obj.map(|o| self.out(o, name)).transpose()
    }

    /// A tensor the call reads whose rows may be strided (the last
    /// dimension contiguous).
    pub fn strided_input(&mut self, obj: &Bound<'_, PyAny>, name: &'static str) -> PyResult<View> {
        self.view(obj, name, false, false)
    }

    /// A tensor the call writes in place whose rows may be strided (the
    /// last dimension contiguous); the kernel checks its rows do not overlap.
    pub fn strided_out(&mut self, obj: &Bound<'_, PyAny>, name: &'static str) -> PyResult<View> {
        self.view(obj, name, true, false)
    }

    /// A kernel's error as a `ValueError`; a size mismatch, which the
    /// kernel states in flattened lengths ("expected length 5005, found
    /// 7007"), followed by the shapes of the call's tensors as the caller
    /// passed them.
    pub fn error(&self, e: KernelError) -> PyErr {
        let sizes = matches!(
            e,
            KernelError::LengthMismatch { .. } | KernelError::InvalidShape { .. }
        );
        if !sizes || self.views.is_empty() {
            return PyValueError::new_err(e.to_string());
        }
        let shapes: Vec<String> = self
            .views
            .iter()
            .map(|v| format!("{} {:?}", v.name, v.shape))
            .collect();
        PyValueError::new_err(format!("{e} (shapes: {})", shapes.join(", ")))
    }

    /// Fails if a written tensor overlaps any other tensor of the call.
    pub fn checked(&self) -> PyResult<()> {
        for (i, a) in self.views.iter().enumerate() {
            for b in &self.views[i + 1..] {
                if !(a.writable || b.writable) || a.span == 0 || b.span == 0 {
                    continue;
                }
                let (a0, a1) = a.byte_range();
                let (b0, b1) = b.byte_range();
                if a0 < b1 && b0 < a1 {
                    return Err(PyValueError::new_err(format!(
                        "{} and {} share memory; kvant writes one while reading the other",
                        a.name, b.name
                    )));
                }
            }
        }
        Ok(())
    }

    /// [`checked`](Self::checked), then the one float dtype of `floats`
    /// ([`same_float`]) with every one of `f32s` float32: the checks every
    /// training binding makes before its kernel runs.
    pub fn checked_float(&self, floats: &[&View], f32s: &[&View]) -> PyResult<Float> {
        self.checked_typed(floats, &[], f32s)
    }

    /// [`checked_float`](Self::checked_float) for a call that also takes
    /// indices: every one of `i64s` int64, checked between the floats and
    /// the float32s.
    pub fn checked_typed(
        &self,
        floats: &[&View],
        i64s: &[&View],
        f32s: &[&View],
    ) -> PyResult<Float> {
        self.checked()?;
        let f = same_float(floats)?;
        i64s.iter().try_for_each(|v| v.expect(Dt::I64).map(drop))?;
        f32s.iter().try_for_each(|v| v.expect(Dt::F32).map(drop))?;
        Ok(f)
    }
}

/// The floating-point element types of the kernels' data tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Float {
    F32,
    Bf16,
}

/// The one float dtype `views` share (f32 or bf16), or a `TypeError`.
pub fn same_float(views: &[&View]) -> PyResult<Float> {
    let first = views.first().map_or(Dt::F32, |v| v.dt);
    if let Some(v) = views.iter().find(|v| v.dt != first) {
        return Err(PyTypeError::new_err(format!(
            "{} is {} but {} is {}; pass tensors of one dtype",
            v.name,
            v.dt.name(),
            views[0].name,
            first.name()
        )));
    }
    match first {
        Dt::F32 => Ok(Float::F32),
        Dt::Bf16 => Ok(Float::Bf16),
        Dt::I64 => Err(PyTypeError::new_err(format!(
            "{} must be float32 or bfloat16, got int64",
            views[0].name
        ))),
    }
}

/// Runs `$body` with `$E` the Rust type of a [`Float`].
macro_rules! with_float {
    ($f:expr, $E:ident => $body:expr) => {
        match $f {
            $crate::tensor::Float::F32 => {
                type $E = f32;
                $body
            }
            $crate::tensor::Float::Bf16 => {
                type $E = half::bf16;
                $body
            }
        }
    };
}
pub(crate) use with_float;

/// Runs a kernel call `$body` with the GIL released and `$E` the Rust type
/// of the [`Float`] `$f`, a kernel error turned into a `ValueError` naming
/// the shapes of the tensors of `$t` ([`Tensors::error`]).
macro_rules! detach_float {
    ($py:expr, $t:expr, $f:expr, $E:ident => $body:expr) => {
        $py.detach(|| $crate::tensor::with_float!($f, $E => $body))
            .map_err(|e| $t.error(e))
    };
}
pub(crate) use detach_float;
