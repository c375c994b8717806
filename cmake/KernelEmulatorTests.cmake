# The CUDA kernels run on the CPU (Note [CUDA emulator] in
# tests/cuda_emulator/emulator.h): every csrc/kernels source, copied with its
# <<<...>>> launches rewritten, is compiled by the host compiler with the
# emulator's kernel language force-included, and linked into two Catch2
# binaries that compare each launch_* with the CPU ops:
#   fusetrain_kernel_tests            (run in both thread orders)
#   fusetrain_kernel_tests_sanitized  (the kernels and the emulator built with
#                                      -fsanitize=address,undefined)
# and, only on request, fusetrain_kernel_tests_mutant (sanitized, from a
# changed copy of csrc/kernels: scripts/kernel-mutants.sh).
# Neither nvcc nor a GPU is needed; the tests' own files are compiled once and
# shared by the binaries.

set(_emu_dir ${PROJECT_SOURCE_DIR}/tests/cuda_emulator)
set(_emu_out ${CMAKE_BINARY_DIR}/emulated_kernels)

# nvcc's headers supply the types (dim3, __half, __nv_bfloat16, float8) and
# their host conversions: those of the nvidia-cuda-runtime wheel that torch
# installs, else a CUDA toolkit's.
execute_process(
  COMMAND ${Python3_EXECUTABLE} -c
    "import glob, os, nvidia; hits = [d for p in nvidia.__path__ for d in sorted(glob.glob(os.path.join(p, 'cu*', 'include'))) if os.path.exists(os.path.join(d, 'cuda_fp16.h'))]; print(hits[-1] if hits else '')"
  OUTPUT_VARIABLE _cuda_wheel_include OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
find_path(FUSETRAIN_EMULATOR_CUDA_INCLUDE cuda_fp16.h
  HINTS ${_cuda_wheel_include} /usr/local/cuda/include NO_DEFAULT_PATH)
if(NOT FUSETRAIN_EMULATOR_CUDA_INCLUDE)
  message(WARNING "fusetrain: no cuda_fp16.h (nvidia-cuda-runtime wheel or CUDA toolkit): "
                  "fusetrain_kernel_tests is not built")
  return()
endif()
message(STATUS "fusetrain: kernel emulator tests with the CUDA headers in ${FUSETRAIN_EMULATOR_CUDA_INCLUDE}")

file(GLOB _emu_kernel_files CONFIGURE_DEPENDS
  ${PROJECT_SOURCE_DIR}/csrc/kernels/*.cu ${PROJECT_SOURCE_DIR}/csrc/kernels/*.cuh
  ${PROJECT_SOURCE_DIR}/tests/kernels/*.cu)
# Rewrites each of _emu_kernel_files into `out_dir`, reading those of
# csrc/kernels from `kernel_dir` (csrc/kernels itself, or a copy of it: the
# mutant check below), and sets `<prefix>_sources` and `<prefix>_headers` to
# the rewritten files. The #line directives name the file read: the project's
# by their path in it, a copy's by its full path, so that messages (and
# sanitizer reports) point into the copy that ran, never the real file.
function(fusetrain_rewrite_kernels kernel_dir out_dir prefix)
  set(_sources "")
  set(_headers "")
  foreach(_src ${_emu_kernel_files})
    get_filename_component(_name ${_src} NAME)
    get_filename_component(_src_dir ${_src} DIRECTORY)
    file(RELATIVE_PATH _rel ${PROJECT_SOURCE_DIR} ${_src})
    if(_src_dir STREQUAL "${PROJECT_SOURCE_DIR}/csrc/kernels"
       AND NOT kernel_dir STREQUAL "${PROJECT_SOURCE_DIR}/csrc/kernels")
      set(_src ${kernel_dir}/${_name})
      set(_rel ${_src})
    endif()
    if(_name MATCHES "\\.cu$")
      set(_out ${out_dir}/${_name}.cpp)
      list(APPEND _sources ${_out})
    else()
      # Rewritten headers sit beside the rewritten sources, which find them
      # first for their quoted includes.
      set(_out ${out_dir}/${_name})
      list(APPEND _headers ${_out})
    endif()
    add_custom_command(OUTPUT ${_out}
      COMMAND ${Python3_EXECUTABLE} ${_emu_dir}/rewrite_launches.py ${_src} ${_out} ${_rel}
      DEPENDS ${_src} ${_emu_dir}/rewrite_launches.py
      COMMENT "Rewriting the launches of ${_rel} for the CUDA emulator" VERBATIM)
  endforeach()
  set_source_files_properties(${_sources} PROPERTIES
    COMPILE_OPTIONS "-include;${_emu_dir}/kernel_language.h;-Wno-unknown-pragmas;-Wno-unused-parameter;-Wno-maybe-uninitialized")
  set(${prefix}_sources ${_sources} PARENT_SCOPE)
  set(${prefix}_headers ${_headers} PARENT_SCOPE)
endfunction()

fusetrain_rewrite_kernels(${PROJECT_SOURCE_DIR}/csrc/kernels ${_emu_out} _emu)

# The emulated kernels and the emulator. Hidden symbols: libfusetrain exports
# the nvcc-compiled launch_* of the same names, and the test binaries must
# neither call those nor hand theirs to the library.
# `kernel_dir` supplies the kernels' plain headers (fp8_scaling.h, the
# launch_* declarations); ARGN: the rewritten sources and headers.
function(fusetrain_emulated_kernels target kernel_dir)
  add_library(${target} STATIC ${ARGN} ${_emu_dir}/emulator.cpp)
  target_include_directories(${target}
    PUBLIC ${_emu_dir} ${FUSETRAIN_EMULATOR_CUDA_INCLUDE}
    PRIVATE ${kernel_dir} ${PROJECT_SOURCE_DIR}/tests/kernels)
  # -ffp-contract=off: no fused multiply-adds where the source has none
  # (nvcc contracts on the GPU; the tests' tolerances allow for it).
  target_compile_options(${target} PRIVATE -ffp-contract=off -fvisibility=hidden -Wall -Wextra)
endfunction()

set(_kernel_dir ${PROJECT_SOURCE_DIR}/csrc/kernels)
fusetrain_emulated_kernels(fusetrain_emulated_kernels ${_kernel_dir} ${_emu_sources} ${_emu_headers})
fusetrain_emulated_kernels(fusetrain_emulated_kernels_sanitized ${_kernel_dir}
  ${_emu_sources} ${_emu_headers})

# The mutant check (scripts/kernel-mutants.sh): the same kernels, rewritten
# from a copy of csrc/kernels in which the script has changed one file, so
# the real sources are never touched. Built only on request, as the copy is
# the script's (without it this target fails to build; configure and `all`
# do not need it). Sanitized, so that a mutant that reads or writes out of
# bounds or misaligned is caught like one that computes wrong values.
set(FUSETRAIN_KERNEL_MUTANT_DIR ${CMAKE_BINARY_DIR}/kernel_mutant CACHE PATH
  "A copy of csrc/kernels (one file changed) that fusetrain_kernel_tests_mutant is built from")
fusetrain_rewrite_kernels(${FUSETRAIN_KERNEL_MUTANT_DIR} ${CMAKE_BINARY_DIR}/emulated_kernels_mutant
  _mutant)
fusetrain_emulated_kernels(fusetrain_emulated_kernels_mutant ${FUSETRAIN_KERNEL_MUTANT_DIR}
  ${_mutant_sources} ${_mutant_headers})
set_target_properties(fusetrain_emulated_kernels_mutant PROPERTIES EXCLUDE_FROM_ALL ON)

set(_sanitize -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer)
foreach(_lib fusetrain_emulated_kernels_sanitized fusetrain_emulated_kernels_mutant)
  target_compile_options(${_lib} PRIVATE -O1 -g ${_sanitize})
  target_link_options(${_lib} INTERFACE ${_sanitize})
endforeach()

# The tests (torch-including files, compiled once for all the binaries).
file(GLOB _kernel_test_sources CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/tests/kernels/*.cpp)
add_library(fusetrain_kernel_test_objects OBJECT ${_kernel_test_sources})
target_link_libraries(fusetrain_kernel_test_objects PRIVATE fusetrain Catch2::Catch2)
target_include_directories(fusetrain_kernel_test_objects PRIVATE
  ${_emu_dir} ${FUSETRAIN_EMULATOR_CUDA_INCLUDE} ${PROJECT_SOURCE_DIR}/csrc/kernels)
fusetrain_reuse_pch(fusetrain_kernel_test_objects)

foreach(_variant "" "_sanitized" "_mutant")
  add_executable(fusetrain_kernel_tests${_variant} $<TARGET_OBJECTS:fusetrain_kernel_test_objects>)
  target_link_libraries(fusetrain_kernel_tests${_variant} PRIVATE
    fusetrain_emulated_kernels${_variant} fusetrain Catch2::Catch2)
endforeach()
set_target_properties(fusetrain_kernel_tests_mutant PROPERTIES EXCLUDE_FROM_ALL ON)
