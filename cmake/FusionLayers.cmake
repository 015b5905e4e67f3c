# FusionLayers.cmake -- one function makes every fusion library, its
# sanitizer twin, and the record of its place among the layers.
#
# fusion_library(NAME
#   SOURCES file...            the library's sources
#   INCLUDE dir...             public include directories: the layer's own folders
#   [INTERNAL dir...]          include directories only the library itself sees
#   [DEPS target...]           what it links: fusion libraries below it (the
#                              _san twin links their _san twins) and external targets
#   [DEFINES def...]           compile definitions its users get
#   [FLAGS flag...])           extra compile options of both variants
#
# The library is made once plain and, when FUSION_SANITIZE_TESTS is on, once
# more as NAME_san, compiled and linked with FUSION_SAN_FLAGS. Both are
# registered in the global property FUSION_LIBS (the plain names), which the
# unit tests link. fusion_write_layers() writes the layer table that
# tests/layers/check_layers.py checks the sources against.
function(fusion_library name)
  cmake_parse_arguments(PARSE_ARGV 1 L "" "" "SOURCES;INCLUDE;INTERNAL;DEPS;DEFINES;FLAGS")
  set(suffixes "")
  if(FUSION_SANITIZE_TESTS)
    list(APPEND suffixes _san)
  endif()
  foreach(suffix "" ${suffixes})
    set(lib ${name}${suffix})
    add_library(${lib} STATIC ${L_SOURCES})
    target_include_directories(${lib} PUBLIC ${L_INCLUDE} PRIVATE ${L_INTERNAL})
    foreach(dep ${L_DEPS})
      if(TARGET ${dep}${suffix})
        target_link_libraries(${lib} PUBLIC ${dep}${suffix})
      else()
        target_link_libraries(${lib} PUBLIC ${dep})
      endif()
    endforeach()
    target_compile_definitions(${lib} INTERFACE ${L_DEFINES})
    target_compile_options(${lib} PRIVATE ${L_FLAGS})
    if(suffix STREQUAL "_san")
      target_compile_options(${lib} PRIVATE ${FUSION_SAN_FLAGS})
      target_link_options(${lib} PUBLIC ${FUSION_SAN_FLAGS})
    endif()
  endforeach()
  set_property(GLOBAL APPEND PROPERTY FUSION_LIBS ${name})

  # The layer record: "NAME|include dirs|internal dirs|fusion libraries it links"
  # (the CUDA objects that fusion_kernels links are part of the kernels layer).
  get_property(made GLOBAL PROPERTY FUSION_LIBS)
  set(fusion_deps "")
  foreach(dep ${L_DEPS})
    if(dep IN_LIST made)
      list(APPEND fusion_deps ${dep})
    endif()
  endforeach()
  string(REPLACE ";" "," inc "${L_INCLUDE}")
  string(REPLACE ";" "," internal "${L_INTERNAL}")
  string(REPLACE ";" "," deps "${fusion_deps}")
  set_property(GLOBAL APPEND PROPERTY FUSION_LAYER_RECORDS "${name}|${inc}|${internal}|${deps}")
endfunction()

# fusion_write_layers(FILE): one line per library, as recorded above.
function(fusion_write_layers file)
  get_property(records GLOBAL PROPERTY FUSION_LAYER_RECORDS)
  string(REPLACE ";" "\n" text "${records}")
  file(WRITE ${file} "${text}\n")
endfunction()
