/* A library loaded at run time (the CUDA runtime, NCCL): dlopen with local symbols, so that its symbols
 * never stand in for another copy that a framework loads later, and its functions looked up by name. */
#ifndef BPS_DL_LIBRARY_H
#define BPS_DL_LIBRARY_H

#include <dlfcn.h>

#include <string>

struct BpsDlLibrary {
    void *lib = nullptr;

    bool loaded() const { return lib != nullptr; }

    /* "<what> failed: <the library's error string> (error <n>)" */
    static std::string failed(const char *what, const char *text, const char *library, int rc) {
        std::string why = text ? text : std::string("unknown ") + library + " error";
        return std::string(what) + " failed: " + why + " (error " + std::to_string(rc) + ")";
    }

  protected:
    std::string missing_;

    /* dlopen ``path`` (``what`` names it in the error); "" or why not */
    std::string open(const std::string &path, const char *what) {
        missing_.clear();
        lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
        if (lib != nullptr) return "";
        const char *why = dlerror();
        return std::string("cannot load ") + what + " " + path + ": " + (why ? why : "dlopen failed");
    }

    template <typename F>
    void find(F *fn, const char *name) {
        *fn = (F)dlsym(lib, name);
        if (*fn == nullptr) missing_ += std::string(" ") + name;
    }

    /* after the finds: "" if every function was there, else unload and say which were not */
    std::string complete(const std::string &path, const char *what) {
        if (missing_.empty()) return "";
        dlclose(lib);
        lib = nullptr;
        return std::string(what) + " " + path + " lacks" + missing_;
    }
};

#endif
