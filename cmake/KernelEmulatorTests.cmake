# The CUDA kernels run on the CPU (Note [CUDA emulator] in
# tests/cuda_emulator/emulator.h): every csrc/kernels source, copied with its
# <<<...>>> launches rewritten, is compiled by the host compiler with the
# emulator's kernel language force-included, and linked into two Catch2
# binaries that compare each launch_* with the CPU ops:
#   fusetrain_kernel_tests            (run in both thread orders)
#   fusetrain_kernel_tests_sanitized  (the kernels and the emulator built with
#                                      -fsanitize=address,undefined)
# Neither nvcc nor a GPU is needed; the tests' own files are compiled once and
# shared by the two binaries.

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
set(_emu_sources "")
set(_emu_headers "")
foreach(_src ${_emu_kernel_files})
  get_filename_component(_name ${_src} NAME)
  file(RELATIVE_PATH _rel ${PROJECT_SOURCE_DIR} ${_src})
  if(_name MATCHES "\\.cu$")
    set(_out ${_emu_out}/${_name}.cpp)
    list(APPEND _emu_sources ${_out})
  else()
    # Rewritten headers sit beside the rewritten sources, which find them
    # first for their quoted includes.
    set(_out ${_emu_out}/${_name})
    list(APPEND _emu_headers ${_out})
  endif()
  add_custom_command(OUTPUT ${_out}
    COMMAND ${Python3_EXECUTABLE} ${_emu_dir}/rewrite_launches.py ${_src} ${_out} ${_rel}
    DEPENDS ${_src} ${_emu_dir}/rewrite_launches.py
    COMMENT "Rewriting the launches of ${_rel} for the CUDA emulator" VERBATIM)
endforeach()
set_source_files_properties(${_emu_sources} PROPERTIES
  COMPILE_OPTIONS "-include;${_emu_dir}/kernel_language.h;-Wno-unknown-pragmas;-Wno-unused-parameter;-Wno-maybe-uninitialized")

# The emulated kernels and the emulator. Hidden symbols: libfusetrain exports
# the nvcc-compiled launch_* of the same names, and the test binaries must
# neither call those nor hand theirs to the library.
function(fusetrain_emulated_kernels target)
  add_library(${target} STATIC ${_emu_sources} ${_emu_headers} ${_emu_dir}/emulator.cpp ${ARGN})
  target_include_directories(${target}
    PUBLIC ${_emu_dir} ${FUSETRAIN_EMULATOR_CUDA_INCLUDE}
    PRIVATE ${PROJECT_SOURCE_DIR}/csrc/kernels ${PROJECT_SOURCE_DIR}/tests/kernels)
  # -ffp-contract=off: no fused multiply-adds where the source has none
  # (nvcc contracts on the GPU; the tests' tolerances allow for it).
  target_compile_options(${target} PRIVATE -ffp-contract=off -fvisibility=hidden -Wall -Wextra)
endfunction()

fusetrain_emulated_kernels(fusetrain_emulated_kernels)
fusetrain_emulated_kernels(fusetrain_emulated_kernels_sanitized)
set(_sanitize -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer)
target_compile_options(fusetrain_emulated_kernels_sanitized PRIVATE -O1 -g ${_sanitize})
target_link_options(fusetrain_emulated_kernels_sanitized INTERFACE ${_sanitize})

# The tests (torch-including files, compiled once for both binaries).
file(GLOB _kernel_test_sources CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/tests/kernels/*.cpp)
add_library(fusetrain_kernel_test_objects OBJECT ${_kernel_test_sources})
target_link_libraries(fusetrain_kernel_test_objects PRIVATE fusetrain Catch2::Catch2)
target_include_directories(fusetrain_kernel_test_objects PRIVATE
  ${_emu_dir} ${FUSETRAIN_EMULATOR_CUDA_INCLUDE} ${PROJECT_SOURCE_DIR}/csrc/kernels)
fusetrain_reuse_pch(fusetrain_kernel_test_objects)

foreach(_variant "" "_sanitized")
  add_executable(fusetrain_kernel_tests${_variant} $<TARGET_OBJECTS:fusetrain_kernel_test_objects>)
  target_link_libraries(fusetrain_kernel_tests${_variant} PRIVATE
    fusetrain_emulated_kernels${_variant} fusetrain Catch2::Catch2)
endforeach()
