/* A library loaded at run time (the CUDA runtime, NCCL): dlopen with local symbols, so that its symbols
 * never stand in for another copy that a framework loads later, and its functions looked up by name. */
#ifndef BPS_DL_LIBRARY_H
#define BPS_DL_LIBRARY_H

#include <dlfcn.h>

#include <string>

struct BpsDlLibrary {
    void *lib = nullptr;
    const char *(*GetErrorString)(int) = nullptr; /* the library's error texts (0: success, as for CUDA and NCCL) */

    /* ``what`` names the library in load errors ("the CUDA runtime"), ``library`` in call errors ("CUDA") */
    BpsDlLibrary(const char *what, const char *library) : what_(what), library_(library) {}

    bool loaded() const { return lib != nullptr; }

    /* "" for success, else "<call> failed: <the library's error string> (error <n>)" */
    std::string check(int rc, const char *call) const {
        if (rc == 0) return "";
        const char *text = GetErrorString != nullptr ? GetErrorString(rc) : nullptr;
        std::string why = text ? text : std::string("unknown ") + library_ + " error";
        return std::string(call) + " failed: " + why + " (error " + std::to_string(rc) + ")";
    }

  protected:
    const char *what_, *library_;
    std::string missing_;

    /* dlopen ``path``; "" or why not */
    std::string open(const std::string &path) {
        missing_.clear();
        lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
        if (lib != nullptr) return "";
        const char *why = dlerror();
        return std::string("cannot load ") + what_ + " " + path + ": " + (why ? why : "dlopen failed");
    }

    template <typename F>
    void find(F *fn, const char *name) {
        *fn = (F)dlsym(lib, name);
        if (*fn == nullptr) missing_ += std::string(" ") + name;
    }

    /* after the finds: "" if every function was there, else unload and say which were not */
    std::string complete(const std::string &path) {
        if (missing_.empty()) return "";
        dlclose(lib);
        lib = nullptr;
        return std::string(what_) + " " + path + " lacks" + missing_;
    }
};

#endif
