// Mapping a page for writing from the program, without changing its byte.
#pragma once

namespace accel::ckpt {

// Maps the page of `p` for writing, as a store from the program does, without changing its byte.
// Why not MADV_POPULATE_WRITE: on a VM whose hypervisor shadows the guest's page tables, a page
// the kernel populated still traps at the program's first store to it. Why an atomic "or 0", not
// a plain store: the program may write into the same page meanwhile, and a zero stored here could
// overwrite what it wrote; a locked "or" never loses a concurrent store. Why the instruction
// itself on x86: a compiler may turn an "or 0" whose result is unused into a plain load (clang
// does), which maps the page for reading only.
inline void touch_for_writing(char* p) {
#if defined(__x86_64__) || defined(__i386__)
  asm volatile("lock orb $0, %0" : "+m"(*p));
#else
  (void)__atomic_fetch_or(reinterpret_cast<volatile char*>(p), char{0}, __ATOMIC_RELAXED);
#endif
}

}  // namespace accel::ckpt
