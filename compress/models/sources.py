"""Models that are not in the registry: `torchvision:<builder>` (any torchvision classification builder:
resnet50, efficientnet_b0, ...) and `<module>:<function>`, the user's own code: `function(num_classes=,
in_channels=, image_size=)` (it receives only the arguments its signature names) returns an nn.Module; the
module is imported from the working directory or an installed package - it is code the user trusts, run as is.
"""

import difflib
import hashlib
import importlib
import importlib.util
import inspect
import logging
import os
import sys

from torch import nn

from compress.errors import InputError

log = logging.getLogger(__name__)

TORCHVISION = "torchvision:"


def torchvision_builders():
    import torchvision.models
    from torchvision.models import list_models

    return list_models(module=torchvision.models)


def user_function(name):
    module_name, _, function_name = name.partition(":")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # `python -m`/console scripts: the working directory is where users' code is
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise InputError(f"cannot import module '{module_name}' for model '{name}' ({e}); a model is a registry name "
                         "(compress models), torchvision:<builder>, or <module>:<function> of a Python file of yours: "
                         "run compress from the folder that holds it, or install its package") from None
    except Exception as e:  # the user's module failed while importing: say where
        raise InputError(f"importing '{module_name}' for model '{name}' failed ({e.__class__.__name__}: "
                         f"{str(e)[:160]})") from None
    fn = getattr(module, function_name, None)
    if not callable(fn):
        raise InputError(f"module '{module_name}' has no function '{function_name}' (model '{name}')")
    return fn


def code_digest(name):
    """A digest of the user's own source files a user model (`<module>:<function>`) is built from, '' for registry
    and torchvision names: editing your model's code, or a file of yours it imports, runs the stages that build it
    again. The files are the one that defines the function and those of the modules it reaches through module
    globals (modules, and the modules that define classes, functions and objects), followed from module to module,
    kept to the folder its top-level module is imported from (never the standard library, installed packages or
    compress). A model whose file reaches no other file of yours keeps the plain sha256 of that file, the digest
    runs recorded before other files were followed, so those runs stay up to date."""
    if ":" not in name or name.startswith(TORCHVISION):
        return ""
    fn = inspect.unwrap(user_function(name))
    try:
        path = inspect.getsourcefile(fn)  # where it is defined, not re-exported
    except TypeError:  # a builtin or a class defined in C: nothing of the user's to follow
        return ""
    if not path or not os.path.isfile(path):
        return ""
    start = sys.modules.get(getattr(fn, "__module__", None) or "")
    files = _user_files(start, os.path.realpath(path)) if start is not None else {}
    if len(files) <= 1:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    h = hashlib.sha256()
    for rel in sorted(files):  # the order of the listing, not of the walk: the same files give the same digest
        h.update(f"{rel}\0{files[rel]}\n".encode())
    return h.hexdigest()


def _user_files(start, path):
    """{path relative to the project folder ('/'-separated): sha256} for `start`, the module that defines the model
    (its file `path`), and the modules of the user's it reaches. Only what the modules' own code binds counts, so
    that the result does not depend on what else the process has imported: a package's attribute that is its own
    submodule is set by any import of that submodule anywhere, so it is followed only where an import statement
    that runs on import (`import pkg.sub`, `from . import sub`) names it."""
    root = _project_folder(start, path)
    top = os.path.join(root, start.__name__.split(".")[0])  # the model's own package: the user's even when installed
    libraries = [d for d in _library_folders() if _inside(d, root)]  # a virtual environment in the project folder
    ours = os.path.realpath(os.path.dirname(os.path.dirname(__file__)))  # compress itself, wherever it lives

    def users(file):
        return bool(file) and _inside(file, root) and not _inside(file, ours) and (
            _inside(file, top) or not any(_inside(file, d) for d in libraries))

    files, seen, todo = {}, {start.__name__}, [start]
    while todo:
        module = todo.pop()
        file = path if module is start else _module_file(module)
        if module is not start and not users(file):
            continue  # not the user's: not hashed, and its own imports not followed
        try:
            with open(file, "rb") as f:
                source = f.read()
        except OSError:
            continue
        files[os.path.relpath(file, root).replace(os.sep, "/")] = hashlib.sha256(source).hexdigest()
        for name in sorted(_referenced(module) | _imported(module, source)):
            if name not in seen and name in sys.modules:
                seen.add(name)
                todo.append(sys.modules[name])
    return files


def _project_folder(module, path):
    """The folder `module` (defined in `path`) is imported from: the one holding its top-level package, or its
    file's folder for a top-level module; its file's folder when the name does not match where the file is."""
    folder = os.path.dirname(path)
    parts = module.__name__.split(".")
    is_package = os.path.splitext(os.path.basename(path))[0] == "__init__"
    up = len(parts) - 1 + is_package
    root = folder
    for _ in range(up):
        root = os.path.dirname(root)
    rel = os.path.relpath(os.path.splitext(path)[0], root).split(os.sep)
    return root if rel == parts + ["__init__"] * is_package else folder


def _library_folders():
    """The interpreter's library folders (standard library, site-packages), real paths."""
    import site
    import sysconfig

    paths = sysconfig.get_paths()
    found = [paths.get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")]
    found += [*site.getsitepackages(), site.getusersitepackages()]
    return [os.path.realpath(d) for d in found if d]


def _inside(path, folder):
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def _module_file(module):
    """The real path of a module's source file (its compiled extension when it has no source), or None."""
    try:
        file = inspect.getsourcefile(module) or getattr(module, "__file__", None)
    except TypeError:  # a builtin module
        return None
    return os.path.realpath(file) if file and os.path.isfile(file) else None


def _referenced(module):
    """Names of the modules `module`'s globals lead to: a module bound by name, and the module that defines a class,
    a function or the class of an object (a layer instance built at import); not the package's own submodules set
    as its attributes by imports elsewhere."""
    names = set()
    for value in list(vars(module).values()):
        if inspect.ismodule(value):
            name = value.__name__
            if not name.startswith(module.__name__ + "."):
                names.add(name)
            continue
        owner = value if inspect.isclass(value) or inspect.isroutine(value) else type(value)
        name = getattr(owner, "__module__", None)
        if isinstance(name, str):
            names.add(name)
    return names


def _imported(module, source):
    """Modules that import statements of `module`'s source name, where the name they bind is in its globals (an
    import inside a function, or under `if TYPE_CHECKING:`, binds none of them, and whether it has run elsewhere
    must not count): `import pkg.sub` binds only `pkg`, and a package's `from . import sub` binds a submodule that
    _referenced leaves out."""
    import ast

    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):  # a compiled extension, or source Python cannot parse: its globals still count
        return set()
    bound = vars(module)

    def binds(name, value):  # whether the global `name` is `value`, which is there
        return value is not None and bound.get(name) is value

    names, todo = set(), list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue  # their imports bind local names
        todo.extend(ast.iter_child_nodes(node))
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names if not a.asname and binds(
                a.name.split(".")[0], sys.modules.get(a.name.split(".")[0])))
        elif isinstance(node, ast.ImportFrom):
            try:
                base = importlib.util.resolve_name("." * node.level + (node.module or ""), module.__package__)
            except (ImportError, ValueError, TypeError):  # a relative import with no package to resolve it in
                continue
            for a in node.names:
                if a.name != "*" and binds(a.asname or a.name, getattr(sys.modules.get(base), a.name, None)):
                    names.update((base, f"{base}.{a.name}"))  # the second counts only where it is a module
    return names


def build_torchvision(name, in_channels, image_size, num_classes):
    """torchvision:<builder>, untrained, with the data's classes and channels."""
    from torchvision.models import get_model_builder

    arch = name[len(TORCHVISION):]
    aux = {"aux_logits": False, "init_weights": True} if arch in ("googlenet", "inception_v3") else {}  # one tensor
    model = get_model_builder(arch)(weights=None, num_classes=num_classes, **aux)
    return adapt_input_channels(model, in_channels)


def torchvision_problem(name):
    builder = name[len(TORCHVISION):]
    known = torchvision_builders()
    if builder in known:
        return None
    close = difflib.get_close_matches(builder, known, n=1)
    hint = f" (did you mean 'torchvision:{close[0]}'?)" if close else ""
    return (f"torchvision has no classification model '{builder}'{hint}; see torchvision.models.list_models() for "
            "the names")


def user_code_problem(name):
    try:
        user_function(name)
    except InputError as e:
        return str(e)
    return None


def build_user_model(name, in_channels, image_size, num_classes):
    """<module>:<function>: the user's function, given the arguments its signature names."""
    fn = user_function(name)
    offered = {"num_classes": num_classes, "in_channels": in_channels, "image_size": tuple(image_size)}
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature: offer everything
        params = None
    takes_all = params is None or any(p.kind == p.VAR_KEYWORD for p in params.values())  # `def f():` gets nothing
    needed = [p.name for p in (params or {}).values() if p.default is p.empty and p.name not in offered
              and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if needed:  # said before the call, which would fail with Python's "missing 1 required positional argument"
        names, many = ", ".join(f"'{n}'" for n in needed), len(needed) > 1
        raise InputError(f"model function '{name}' requires the argument{'s' if many else ''} {names}, which "
                         "compress does not pass (it passes only num_classes, in_channels and image_size - a (height, "
                         f"width) tuple - to parameters of those names); give {'each of them' if many else names} a "
                         "default")
    try:
        model = fn(**{k: v for k, v in offered.items() if takes_all or k in params})
    except Exception as e:
        raise InputError(f"model function '{name}' failed ({e.__class__.__name__}: {str(e)[:160]})") from None
    if not isinstance(model, nn.Module):
        raise InputError(f"model function '{name}' returned {type(model).__name__}, not a torch.nn.Module")
    return model


def adapt_input_channels(model, in_channels):
    """Replace the first convolution when the images have another channel count than the model expects."""
    for parent in model.modules():
        for child_name, child in parent.named_children():
            if isinstance(child, nn.Conv2d):
                if child.in_channels != in_channels:
                    setattr(parent, child_name, nn.Conv2d(
                        in_channels, child.out_channels, child.kernel_size, child.stride, child.padding,
                        child.dilation, child.groups if child.groups == 1 else in_channels, child.bias is not None))
                return model
    return model
