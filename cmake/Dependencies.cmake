# Third-party packages. Debian's CMake configs where they are installed;
# otherwise plain header and library look-ups under CMAKE_PREFIX_PATH (the GPU
# box, which has no Debian dev packages, gets the same files staged into
# .gpu-deps/ by scripts/stage-gpu-deps.sh).

find_package(cxxopts QUIET)
if(NOT TARGET cxxopts::cxxopts)
  find_path(CXXOPTS_INCLUDE_DIR cxxopts.hpp REQUIRED)
  add_library(cxxopts::cxxopts INTERFACE IMPORTED)
  target_include_directories(cxxopts::cxxopts INTERFACE ${CXXOPTS_INCLUDE_DIR})
endif()

find_package(yaml-cpp QUIET)
if(NOT TARGET yaml-cpp)
  find_path(YAML_CPP_INCLUDE_DIR yaml-cpp/yaml.h REQUIRED)
  find_library(YAML_CPP_LIBRARY yaml-cpp REQUIRED)
  add_library(yaml-cpp UNKNOWN IMPORTED)
  set_target_properties(yaml-cpp PROPERTIES IMPORTED_LOCATION ${YAML_CPP_LIBRARY}
    INTERFACE_INCLUDE_DIRECTORIES ${YAML_CPP_INCLUDE_DIR})
endif()

find_package(ZLIB REQUIRED)

find_package(nlohmann_json 3 QUIET)
if(NOT TARGET nlohmann_json::nlohmann_json)
  find_path(NLOHMANN_JSON_INCLUDE_DIR nlohmann/json.hpp REQUIRED)
  add_library(nlohmann_json::nlohmann_json INTERFACE IMPORTED)
  target_include_directories(nlohmann_json::nlohmann_json INTERFACE ${NLOHMANN_JSON_INCLUDE_DIR})
endif()

# Declarations only: torch's ProcessGroupGloo.hpp includes gloo's headers.
find_path(GLOO_INCLUDE_DIR gloo/algorithm.h REQUIRED)

if(FUSETRAIN_TESTS)
  find_package(Catch2 QUIET)
  if(NOT TARGET Catch2::Catch2)
    find_path(CATCH2_INCLUDE_DIR catch2/catch.hpp REQUIRED)
    add_library(Catch2::Catch2 INTERFACE IMPORTED)
    target_include_directories(Catch2::Catch2 INTERFACE ${CATCH2_INCLUDE_DIR})
  endif()
endif()
